"""The model definitions: shapes, built-in normalisation, saving as a plain state_dict."""

from __future__ import annotations

import io

import pytest
import torch

from pipeline.architectures import nets
from pipeline.architectures.signnet import SignNet

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


def test_image_normalisation_standardises_each_image_and_ignores_exposure() -> None:
    model = nets.build("signnet", MEAN, STD, 32, input_norm="image").eval()
    x = torch.rand(4, 3, 32, 32) * 0.5 + 0.1
    z = model.normalize(x)
    assert torch.allclose(z.mean(dim=(1, 2, 3)), torch.zeros(4), atol=1e-5)
    assert torch.allclose(z.std(dim=(1, 2, 3), unbiased=False), torch.ones(4), atol=1e-2)
    # A darker, lower-contrast copy of the same photo (x * 0.3 + 0.05) looks the same to the network.
    torch.testing.assert_close(model(x * 0.3 + 0.05), model(x), atol=1e-3, rtol=1e-3)
    # A flat image is not blown up into noise.
    assert model.normalize(torch.full((1, 3, 8, 8), 0.7)).abs().max() < 1e-3


def test_saved_arch_rebuilds_the_same_network_and_old_files_default_to_dataset_norm() -> None:
    model = nets.build("signnet", MEAN, STD, 32, width=8, input_norm="image").eval()
    arch = nets.arch_kwargs("signnet", 32, width=8, input_norm="image")
    again = nets.build_from_arch(arch, MEAN, STD).eval()
    again.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(model(x), again(x))
    old = {k: v for k, v in arch.items() if k != "input_norm"}  # saved before input_norm existed
    assert nets.build_from_arch(old, MEAN, STD).normalize.mode == "dataset"  # type: ignore[union-attr]


def test_unknown_input_normalisation_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown input normalisation"):
        nets.build("signnet", MEAN, STD, 32, input_norm="clahe")


def test_committee_members_start_apart_and_vote_with_their_mean_probability() -> None:
    torch.manual_seed(0)
    committee = nets.build("signnet", MEAN, STD, 32, width=8, members=3, input_norm="image")
    assert isinstance(committee, nets.Committee) and len(committee.members) == 3
    first, second = (m.features[0].weight for m in committee.members[:2])  # type: ignore[index]
    assert not torch.equal(first, second)  # differently initialised, or the vote would add nothing
    x = torch.rand(5, 3, 32, 32)
    committee.train()
    assert committee(x).shape == (3, 5, 43)  # training: each member's own logits
    committee.eval()
    with torch.no_grad():
        mean_probability = torch.stack([m(x).softmax(1) for m in committee.members]).mean(0)
        out = committee(x)
    assert out.shape == (5, 43)
    torch.testing.assert_close(out.softmax(1), mean_probability)
    torch.testing.assert_close(out.exp().sum(1), torch.ones(5))  # log-probabilities: softmax(out) == exp(out)


def test_member_losses_are_stacked_along_the_batch() -> None:
    logits, labels = torch.randn(2, 4, 43), torch.tensor([1, 2, 3, 4])
    flat_logits, flat_labels = nets.member_loss_inputs(logits, labels)
    assert flat_logits.shape == (8, 43) and flat_labels.tolist() == [1, 2, 3, 4] * 2
    summed = torch.nn.functional.cross_entropy(flat_logits, flat_labels, reduction="sum")
    each = sum(torch.nn.functional.cross_entropy(m, labels, reduction="sum") for m in logits)
    torch.testing.assert_close(summed, each)
    single = torch.randn(4, 43)
    assert nets.member_loss_inputs(single, labels)[0] is single


def test_committee_arch_round_trips_and_old_files_are_single_networks() -> None:
    model = nets.build("signnet", MEAN, STD, 32, width=8, members=2).eval()
    arch = nets.arch_kwargs("signnet", 32, width=8, members=2)
    again = nets.build_from_arch(arch, MEAN, STD).eval()
    again.load_state_dict(model.state_dict())
    x = torch.rand(2, 3, 32, 32)
    assert torch.equal(model(x), again(x))
    old = {k: v for k, v in arch.items() if k != "members"}
    assert isinstance(nets.build_from_arch(old, MEAN, STD), SignNet)
    with pytest.raises(ValueError, match="members"):
        nets.build("signnet", MEAN, STD, 32, members=0)
