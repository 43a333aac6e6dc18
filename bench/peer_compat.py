"""The peer's own test suite, unmodified, run against the ``transfer_queue`` facade.

    python -m bench.peer --compat            # every test of the public API; prints pass/fail
    python -m bench.peer --compat -k grpo    # a subset (pytest's -k)

Takes the ``tests/`` folder of TransferQueue 0.1.11's wheel (PyPI ``transferqueue``; the wheel
ships it, the package's sdist is not needed), downloaded once into ``bench/.peer-cache``
(git-ignored; ``TQ_COMPAT_CACHE`` moves it) with ``pip download --no-deps``: only the tests are
extracted, never the peer's package, so ``import transfer_queue`` finds the facade through the
opt-in the docs give, the shim on ``PYTHONPATH`` (:mod:`tqcompat.shim`). This process starts a
Ray head and hands its address to the tests (``RAY_ADDRESS``): the peer's end-to-end tests call
``ray.init()``, which joins it instead of starting a cluster per module.

The tests that read the peer's internals (its controller actor's private calls, its storage
classes, ZeroMQ messages, files on disk) are listed in :data:`EXCLUDED` with the reason; every
other test of the suite is a test of the public API and is expected to pass. The summary line
is ``passed / public-API tests``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from bench.common import RESULTS_DIR
from tqcompat.alias import SHIM_PATH

VERSION = "0.1.11"
REPO_DIR = Path(__file__).resolve().parent.parent
CACHE_DIR = Path(os.environ.get("TQ_COMPAT_CACHE", REPO_DIR / "bench" / ".peer-cache"))
_TEST_TIMEOUT_S = 1800.0

# Test files the peer's suite holds; those not named in EXCLUDED run whole.
_WHY_INTERNAL = "imports the peer's internals"
EXCLUDED: dict[str, str] = {
    # whole files: they import modules that exist only inside the peer
    "tests/test_accept_probe.py": f"{_WHY_INTERNAL} (transfer_queue.utils.accept_probe)",
    "tests/test_async_simple_storage_manager.py": (
        f"{_WHY_INTERNAL} (transfer_queue.storage: its storage manager, mocked ZeroMQ)"
    ),
    "tests/test_client.py": (
        f"{_WHY_INTERNAL} (transfer_queue.utils.zmq_utils: drives the client against mock "
        "ZeroMQ servers speaking the peer's wire messages)"
    ),
    "tests/test_controller.py": f"{_WHY_INTERNAL} (TransferQueueController's ZeroMQ handlers)",
    "tests/test_controller_data_partitions.py": (
        f"{_WHY_INTERNAL} (transfer_queue.controller.DataPartitionStatus, private state)"
    ),
    "tests/test_kv_storage_manager.py": f"{_WHY_INTERNAL} (storage.managers.base)",
    "tests/test_metrics.py": f"{_WHY_INTERNAL} (transfer_queue.metrics exporter, ZeroMQ)",
    "tests/test_mooncake_utils.py": f"{_WHY_INTERNAL} (Mooncake backend, refused at init)",
    "tests/test_ray_p2p.py": f"{_WHY_INTERNAL} (storage.managers, the peer's Ray transport)",
    "tests/test_serial_utils_batch_on_cpu.py": f"{_WHY_INTERNAL} (utils.serial_utils)",
    "tests/test_serial_utils_on_cpu.py": f"{_WHY_INTERNAL} (utils.serial_utils, wire)",
    "tests/test_simple_storage_scheduling.py": f"{_WHY_INTERNAL} (storage.bootstrap)",
    "tests/test_simple_storage_unit.py": f"{_WHY_INTERNAL} (storage.simple_storage)",
    "tests/test_storage_client_factory.py": f"{_WHY_INTERNAL} (storage.clients)",
    "tests/test_storage_key_race.py": f"{_WHY_INTERNAL} (storage.simple_storage)",
    "tests/test_storage_request_retry.py": f"{_WHY_INTERNAL} (storage.managers)",
    "tests/test_tensor_utils.py": f"{_WHY_INTERNAL} (utils.tensor_utils helpers)",
    "tests/test_yuanrong_client_zero_copy.py": f"{_WHY_INTERNAL} (Yuanrong backend)",
    "tests/test_yuanrong_storage_client_e2e.py": f"{_WHY_INTERNAL} (Yuanrong backend)",
    "tests/test_zmq_shared_context.py": f"{_WHY_INTERNAL} (utils.zmq_utils)",
    "tests/test_zmq_socket_pool.py": f"{_WHY_INTERNAL} (utils.zmq_utils)",
    "tests/sanity": "the peer's source checks (license headers, docstrings), not tests",
    "tests/e2e/test_ssd_offload_e2e.py": (
        "the peer's SimpleStorage SSD offload (backend.SimpleStorage.ssd_offload): asserts its "
        "files under the offload folder; our units hold rows in memory and spill nothing"
    ),
    # single tests of the public files
    "tests/test_metadata.py::TestBatchMetaColumnar::test_chunk": (
        "builds a BatchMeta with the peer's private _custom_backend_meta (per-row keys of its "
        "storage backends; ours travel in BatchMeta.native)"
    ),
    "tests/test_metadata.py::TestBatchMetaColumnar::test_custom_backend_meta": (
        "reads the peer's private _custom_backend_meta"
    ),
    "tests/test_metadata.py::TestBatchMetaColumnar::test_setstate_readonly_production_status": (
        "takes apart the peer's pickled state (a tuple laid out by BatchMeta.__slots__)"
    ),
    "tests/test_metadata.py::TestStorageUnitDataStrict": (
        f"{_WHY_INTERNAL} (storage.simple_storage.StorageUnitData)"
    ),
    "tests/test_samplers.py::TestSeqlenBalancedSampler": (
        "SeqlenBalancedSampler is refused at init (use our 'balanced' sampler), and its sample() "
        "reads the peer controller's partition objects (DataPartitionStatus.get_custom_meta)"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_tensor_fields": (
        "asserts the peer's files on disk (metadata.json, controller_state.pkl, simple_storage/)"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_controller_metadata": (
        "reads the peer controller's private state (get_partition_snapshot().keys_mapping)"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointRoundtrip::test_user_metadata_preserved": (
        "reads the peer's metadata.json"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestIncludeStorageFalse": (
        "the peer's files on disk and its controller's get_partition_snapshot; "
        "include_storage=False is refused here (one snapshot holds rows and state together)"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_save_raises_if_not_initialized": (
        "patches the peer's private transfer_queue.interface._TQ_CONTROLLER"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors::test_load_raises_if_not_initialized": (
        "patches the peer's private transfer_queue.interface._TQ_CONTROLLER"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors"
    "::test_load_raises_if_metadata_missing": (
        "names the peer's file (metadata.json); here a folder without our manifest.json is "
        "our CheckpointError"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors"
    "::test_load_raises_on_storage_unit_count_mismatch": (
        "edits the peer's simple_storage/storage_unit_info.json"
    ),
    "tests/e2e/test_checkpoint_e2e.py::TestCheckpointErrors"
    "::test_no_partial_state_on_failed_save": (
        "patches the peer client's private save_storage_checkpoint"
    ),
    "tests/e2e/test_e2e_lifecycle_consistency.py::test_dynamic_tensor_shape_nested_transition": (
        "asserts that a dense field reads back as a nested tensor (the peer's reads are "
        "nested); here a dense field reads back dense, torch.equal to what was put"
    ),
    **{
        f"tests/e2e/test_kv_interface_e2e.py::{test}": (
            "reads the peer controller's private state (get_partition_snapshot: "
            "field_schema, production status, keys_mapping)"
        )
        for test in (
            "TestKVPutE2E::test_kv_put_single_sample_with_fields_and_tag",
            "TestKVPutE2E::test_kv_put_update_tag_only",
            "TestKVPutE2E::test_kv_put_partial_update",
            "TestKVBatchPutE2E::test_kv_batch_put_multiple_samples",
            "TestKVBatchPutE2E::test_kv_batch_put_partial_update",
            "TestKVClearE2E::test_kv_clear_single_key",
            "TestKVClearE2E::test_kv_clear_idempotent",
            "TestKVE2ECornerCases::test_field_expansion_across_samples",
        )
    },
}


def fetch_tests(cache: Path = CACHE_DIR) -> Path:
    """A folder holding the peer's ``tests/`` (and nothing of its package), from its wheel
    downloaded into ``cache`` the first time."""
    root = cache / f"transferqueue-{VERSION}-tests"
    if not (root / "tests" / "test_metadata.py").exists():
        wheels = cache / "wheels"
        if not any(wheels.glob(f"transferqueue-{VERSION}-*.whl")):
            pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
            subprocess.run(
                [*pip, f"transferqueue=={VERSION}", "-d", str(wheels)],
                check=True,
                timeout=600,
            )
        wheel = next(wheels.glob(f"transferqueue-{VERSION}-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            for name in zf.namelist():
                if name.startswith("tests/"):
                    zf.extract(name, root)  # only the tests: never the peer's package
        # an ini of its own: pytest must not take this repository's settings (or conftest)
        (root / "pytest.ini").write_text("[pytest]\n", encoding="utf-8")
    return root


def _selection(root: Path) -> tuple[list[str], list[str]]:
    """The test files to run and the node ids to deselect within them."""
    files = sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py"))
    run = [f for f in files if not any(f == e or f.startswith(e + "/") for e in EXCLUDED)]
    deselect = [e for e in EXCLUDED if "::" in e]
    return run, deselect


def _results(stdout: str) -> dict[str, str]:
    """node id -> passed / failed / error, from pytest's ``-rA`` summary (a file that fails
    to import is one error under its path); skipped tests are counted apart."""
    out: dict[str, str] = {}
    for raw in stdout.splitlines():
        status, _, rest = raw.partition(" ")
        if status in ("PASSED", "FAILED", "ERROR") and rest.startswith("tests/"):
            node = rest.split(" - ")[0].strip()
            out[node] = status.lower()
    return out


def run(extra: list[str] | None = None) -> int:
    """Run the public-API tests; prints one line per test and the summary."""
    import ray

    root = fetch_tests()
    files, deselect = _selection(root)
    path = os.pathsep.join(p for p in (SHIM_PATH, str(REPO_DIR), os.environ.get("PYTHONPATH")) if p)
    # the Ray head's processes start with this environment, and the workers of the tests'
    # drivers with theirs: the shim reaches every worker
    os.environ["PYTHONPATH"] = path
    ray.init(include_dashboard=False, log_to_driver=False)
    try:
        env = {
            **os.environ,
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
            "PYTHONPATH": path,
        }
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"]
        cmd += ["--continue-on-collection-errors", *files]
        cmd += [a for d in deselect for a in ("--deselect", d)] + (extra or [])
        t0 = time.perf_counter()
        proc = subprocess.run(
            cmd, cwd=root, env=env, capture_output=True, text=True, timeout=_TEST_TIMEOUT_S
        )
        wall_s = time.perf_counter() - t0
        results = _results(proc.stdout)
        if not results:
            print(proc.stdout[-5000:] + proc.stderr[-5000:])
            raise RuntimeError(f"pytest reported no test (exit {proc.returncode})")
    finally:
        ray.shutdown()
    for node, status in results.items():
        print(f"{status.upper():8} {node}")
    for node, why in EXCLUDED.items():
        print(f"EXCLUDED {node}  ({why})")
    counts = {s: sum(v == s for v in results.values()) for s in ("passed", "failed", "error")}
    public = counts["passed"] + counts["failed"] + counts["error"]
    skipped = proc.stdout.count("\nSKIPPED ")
    failing = [n for n, s in results.items() if s in ("failed", "error")]
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    log = RESULTS_DIR / "peer-compat.log"
    log.write_text(proc.stdout + proc.stderr, encoding="utf-8")
    if failing:
        print(f"pytest's report: {log}")
    print(
        f"peer suite {VERSION} on the facade: {counts['passed']} / {public} public-API tests "
        f"passed ({counts['failed']} failed, {counts['error']} errors, {skipped} skipped by "
        f"the peer's own marks; {len(EXCLUDED)} exclusions) in {wall_s:.0f} s",
        flush=True,
    )
    return 1 if failing else 0
