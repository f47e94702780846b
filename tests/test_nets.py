"""The model definitions: shapes, built-in normalisation, saving as a plain state_dict."""

from __future__ import annotations

import io

import pytest
import torch

from pipeline import nets

MEAN, STD = [0.4, 0.35, 0.3], [0.25, 0.24, 0.23]


@pytest.mark.parametrize("name", nets.ARCHITECTURES)
@pytest.mark.parametrize("size", [32, 48])
def test_models_map_images_to_43_logits(name: str, size: int) -> None:
    model = nets.build(name, MEAN, STD, size).eval()
    out = model(torch.rand(2, 3, size, size))
    assert out.shape == (2, 43)
    assert torch.isfinite(out).all()


def test_trafficsignnet_is_the_reference_architecture() -> None:
    model = nets.build("trafficsignnet", MEAN, STD, 32)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert [(c.in_channels, c.out_channels, c.kernel_size) for c in convs] == [(3, 32, (3, 3)), (32, 64, (3, 3))]
    assert [(fc.in_features, fc.out_features) for fc in linears] == [(2304, 128), (128, 43)]


def test_normalisation_lives_in_the_model() -> None:
    model = nets.build("signnet", MEAN, STD, 32)
    state = model.state_dict()
    assert torch.allclose(state["normalize.mean"].flatten(), torch.tensor(MEAN))
    assert torch.allclose(state["normalize.std"].flatten(), torch.tensor(STD))
    x = torch.full((1, 3, 4, 4), 0.5)
    expected = (0.5 - torch.tensor(MEAN)) / torch.tensor(STD)
    assert torch.allclose(model.normalize(x)[0, :, 0, 0], expected)


def test_state_dict_round_trips_with_weights_only() -> None:
    model = nets.build("signnet", MEAN, STD, 32, width=8).eval()
    buffer = io.BytesIO()
    torch.save({"arch": nets.arch_kwargs("signnet", 32, width=8), "state_dict": model.state_dict()}, buffer)
    buffer.seek(0)
    payload = torch.load(buffer, weights_only=True)
    again = nets.build("signnet", MEAN, STD, 32, width=int(payload["arch"]["width"])).eval()
    again.load_state_dict(payload["state_dict"])
    x = torch.rand(3, 3, 32, 32)
    assert torch.equal(model(x), again(x))


def test_unknown_model_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        nets.build("resnet", MEAN, STD, 32)
