"""A candidate compiled in a worker process is written for the program's thread count: the
worker runs one torch thread, and Inductor writes its C++ kernels for the compiling
process's ``torch.get_num_threads()`` unless told otherwise (a program on 4 threads would
get single-threaded kernels, slower in its trial than the pinned backend's)."""
import pytest
import torch
import torch._inductor
from torch._inductor import utils as inductor_utils

from specularch.fx_lower import _torch_compilers as compilers
from specularch.tiering import compile_worker, job as jobs, process


class Stop(BaseException):  # (not an Exception: inductor_artifact falls back on those)
    pass


def _graph():
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x) * 2)
    example = torch.randn(4, 4)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["example"] = example
    return gm, [example]


@pytest.mark.parametrize("threads", [3, None])
@pytest.mark.parametrize("compiler, aoti", [("aoti_compile_and_package", True),
                                            ("standalone_compile", False)])
def test_inductor_artifact_writes_kernels_for_the_given_threads(monkeypatch, tmp_path, threads,
                                                                compiler, aoti):
    seen = []

    def compile(*args, **kwargs):
        seen.append(inductor_utils.parallel_num_threads())
        raise Stop
    monkeypatch.setattr(torch._inductor, compiler, compile)
    gm, examples = _graph()
    with pytest.raises(Stop):
        compilers.inductor_artifact(gm, examples, str(tmp_path / "a"), threads=threads, aoti=aoti)
    assert seen == [threads or torch.get_num_threads()]


def test_the_worker_is_told_the_programs_threads(monkeypatch, tmp_path):
    """The job the program writes carries its thread count, and the worker passes it on; on
    several threads it is not given to a forked worker (``process.forkable``)."""
    jobs_seen, passed = [], []

    def run(folder, timeout, may_fork):
        jobs_seen.append((torch.load(f"{folder}/job.pt", weights_only=False), may_fork))
        raise Stop
    monkeypatch.setattr(process, "_run", run)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        gm, examples = _graph()
        with pytest.raises(Stop):
            process.compile_candidate("inductor", gm, examples, timeout=5)
    finally:
        torch.set_num_threads(threads)
    ((job, may_fork),) = jobs_seen
    assert job["threads"] == 3 and may_fork is False
    monkeypatch.setattr(compilers, "inductor_artifact",
                        lambda gm, examples, path, threads=None, aoti=False: passed.append(threads) or {})
    compile_worker._compile(job, *jobs.unpack(job), str(tmp_path / "artefact"))
    assert passed == [3]
