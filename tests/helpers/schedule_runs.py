"""The model and splits on which every schedule is run by real ranks (native and torch executors)."""

from __future__ import annotations

from gpipe_plan.models import model_spec

# 8 layers (embedding, 6 blocks, head): enough for 2 chunks on each of 4 stages.
GPT = model_spec("gpt", layers=6, width=16, heads=2, seq_len=8, vocab_size=64)
LAYERS = 8
STEPS = 3

# schedule, chunks per stage
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]


def even_balance(chunks: int) -> list[int]:
    """LAYERS layers in ``chunks`` runs, as even as they go (the first ones longer)."""
    base, extra = divmod(LAYERS, chunks)
    return [base + (1 if c < extra else 0) for c in range(chunks)]
