"""Server processes keep freed payload memory: repeated puts land in reused pages, not in fresh
ones the kernel must fault in (``transferqueue.storage.malloc``)."""

from __future__ import annotations

import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import transferqueue
from transferqueue import Ragged
from transferqueue.storage.malloc import keep_freed_memory

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="needs glibc")
# Per 4 KiB page; a put of 4.4 MB into fresh memory faults about 1,100 of them.
FAULTS_PER_PUT_MAX = 50


def _minor_faults(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


@glibc
def test_tuned_process_reuses_freed_buffers() -> None:
    # A fresh interpreter, so that nothing this test process allocated before shapes the
    # allocator's adaptive thresholds; with the modules a unit's process imports (with torch
    # alone, one run in about a dozen on a loaded machine faulted 2,700 pages).
    code = textwrap.dedent(
        """
        import resource, torch
        import transferqueue.deploy.server  # what a unit's process has imported when it tunes
        from transferqueue.storage.malloc import keep_freed_memory
        assert keep_freed_memory()
        def cycle():
            a = torch.empty(550_000, dtype=torch.int32); a.fill_(1)
            b = torch.empty(550_000, dtype=torch.float32); b.fill_(1)
        for _ in range(5):
            cycle()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(20):
            cycle()
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    faults = int(out.stdout.split()[-1])
    assert faults <= 20 * FAULTS_PER_PUT_MAX, f"{faults} page faults in 20 alloc/free cycles"


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="thresholds must be > 0"):
        keep_freed_memory(0, 1 << 20)


def test_opt_out_leaves_the_allocator_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRANSFERQUEUE_DEFAULT_MALLOC", "1")
    assert keep_freed_memory() is False


@glibc
@pytest.mark.service
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_unit_process_reuses_memory_across_puts() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(128, 4097, (256,), generator=g).tolist()
    ids = Ragged.from_tensors([torch.randint(0, 50_000, (n,), dtype=torch.int32) for n in lengths])
    logp = Ragged.from_tensors([-torch.rand(n, generator=g) for n in lengths])
    cols = {"ids": ids, "logprobs": logp}
    with transferqueue.serve(num_units=1) as svc, transferqueue.connect(svc.address) as tq:
        unit_pid = svc.pids[0]  # units are started first
        client = tq.client()
        client.declare_tasks(["t"])

        def cycle() -> None:
            client.put(cols, group=0)
            meta = client.get_meta("t", list(cols), 256, timeout_s=30)
            same = torch.equal(client.get_data(meta)["ids"].values, ids.values)
            client.ack(meta)
            assert same

        for _ in range(5):
            cycle()
        per_put = []
        for _ in range(20):
            before = _minor_faults(unit_pid)
            cycle()
            per_put.append(_minor_faults(unit_pid) - before)
    # Memory freed by one put is reused by the next: most puts fault in (almost) nothing. The
    # heap may still grow now and then; what must not happen is a fresh buffer every put
    # (about 1,060 faults each here, which the allocator's own thresholds give in some runs).
    assert sorted(per_put)[len(per_put) // 2] <= FAULTS_PER_PUT_MAX, (
        f"the unit faulted in pages at every put: {per_put} (a put is "
        f"{ids.nbytes + logp.nbytes} bytes)"
    )
