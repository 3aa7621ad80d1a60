"""The supervised training step the PyTorch peers time (`torch_supervised_peer.py`, `torch_vit_peer.py`)."""

from __future__ import annotations

import time


def time_supervised_steps(torch, model, optimizer, images, labels, precision: str, steps: int, warmup: int) -> tuple[float, float]:
    """Cross-entropy steps in float32 (`fp32`) or under `torch.autocast(bfloat16)` (`bf16`), logits in float32:
    `warmup` untimed, then `steps` timed. Returns (seconds of the timed steps, the last loss)."""
    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            logits = model(images)
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(warmup):
        step()
    start = time.perf_counter()
    for _ in range(steps):
        loss = step()
    return time.perf_counter() - start, float(loss.detach())
