from pathlib import Path

import pytest

from benchmarks import cpu_split

PROFILE = """\
Runner.run (asyncio/runners.py:118);HotPath.__call__ (pipeline/serve/app.py:330);Inference.decode (pipeline/serve/app.py:460);decode_opened (pipeline/serve/protocol.py:230);load (pyspng/__init__.py:40) 42
DynamicBatcher._worker (pipeline/serve/batcher.py:180);ServedModel.probabilities (pipeline/serve/model.py:80);Session.run (onnxruntime/capi/onnxruntime_inference_collection.py:266) 36
Runner.run (asyncio/runners.py:118);HttpToolsProtocol.data_received (uvicorn/protocols/http/httptools_impl.py:171) 7
Runner.run (asyncio/runners.py:118);HotPath.__call__ (pipeline/serve/app.py:340) 5
Runner.run (asyncio/runners.py:118);BaseEventLoop._run_once (asyncio/base_events.py:1900) 3
Runner.run (asyncio/runners.py:118);HotPath.__call__ (pipeline/serve/app.py:350);log_request (pipeline/serve/access.py:60) 2
Runner.run (asyncio/runners.py:118);mystery (somewhere.py:1) 5
"""


def test_each_sample_goes_to_its_part_of_the_request() -> None:
    counts = cpu_split.split([*PROFILE.splitlines(), "", "not a sample line"])
    assert counts["decode and framing (libspng, PIL, resize)"] == 42
    assert counts["the model (Session.run, batcher thread)"] == 36
    assert counts["uvicorn + httptools"] == 7
    assert counts["our handlers, batcher queueing"] == 5
    assert counts["asyncio / uvloop"] == 3
    assert counts["request id, access log, metrics, drift counts"] == 2
    assert counts["other: mystery"] == 5
    assert sum(counts.values()) == 100


def test_the_command_prints_shares_and_refuses_an_empty_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.txt"
    profile.write_text(PROFILE)
    cpu_split.main([str(profile)])
    out = capsys.readouterr().out
    assert " 42.0 %  decode and framing" in out and "100 samples" in out
    profile.write_text("")
    with pytest.raises(SystemExit, match="no samples"):
        cpu_split.main([str(profile)])
