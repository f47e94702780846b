"""The training engine shared by the train stage, optimize's fine-tune and `python -m benchmarks train`.

engine.py        optimizer parameter groups, the one-cycle LR schedule, the loss (committee members,
                 label smoothing, logit adjustment, distillation from a teacher) and one training step
distributed.py   devices, bf16 autocast, processes (spawn / torchrun), DDP and FSDP2 wrapping
checkpoint.py    torch.distributed.checkpoint folders: sealed, verified, resumed; one folder per params + data
                 fingerprint, the newest kept
inputs.py        what the train stage starts from: the prepared data, the network and its initial weights
loop.py          the train stage's run in one process (`worker`): epochs, checkpoints, models/model.pt
state.py         what that run carries through a checkpoint (trainer.json), typed
budget.py        the time budget (`train.max_minutes`): the epochs planned after each epoch
stopping.py      early stopping (`train.early_stopping_patience`): the best epoch kept
launch.py        the train stage's spawned processes, and torchrun's checks before any step
features.py      `train.from_pretrained: features`: the head on cached frozen features, then the last blocks
pace.py          the input size a machine can train within `train.max_minutes` (prepare's data.min_image_size)
"""
