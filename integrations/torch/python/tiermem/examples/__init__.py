"""Examples and benchmarks; ``timed_step`` is the one training step the benchmarks time."""
import time


def timed_step(model, opt, x, y):
    """zero_grad, forward (the model returns the loss), backward, step: (loss, seconds)."""
    t0 = time.perf_counter()
    opt.zero_grad()
    loss = model(x, y)
    loss.backward()
    opt.step()
    return loss.item(), time.perf_counter() - t0
