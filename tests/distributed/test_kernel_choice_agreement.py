"""``auto`` measured on two TP ranks whose timers disagree: both must run the kernel TP rank 0 picked.

Replicated weights (norm gamma/beta) get no TP all-reduce, so two TP ranks running different kernels would
let them drift apart. Each rank here is given a fake timer that makes a *different* backend fastest."""

from tests.launch import run_distributed


def _worker():
    import torch

    from megatron.core.parallel_state import ParallelState, set_parallel_state
    from megatron.initialize import initialize_distributed
    from megatron.kernels import measure

    initialize_distributed("gloo")
    state = ParallelState.build(2)
    set_parallel_state(state)
    # rank 0 measures "b" fastest, rank 1 measures "a" fastest.
    costs = [{"torch": 3.0, "a": 2.0, "b": 1.0}, {"torch": 3.0, "a": 1.0, "b": 2.0}][state.tp.rank]
    measure.set_timer(lambda name, thunk: costs[name])
    cands = {name: (lambda: None) for name in costs}
    picked = [measure._measure(f"op{i}", lambda: cands, torch.device("cpu")) for i in range(2)]
    set_parallel_state(None)
    return picked


def test_tp_ranks_agree_on_rank0_choice():
    results = run_distributed(_worker, 2)
    assert results == [["b", "b"], ["b", "b"]], results
