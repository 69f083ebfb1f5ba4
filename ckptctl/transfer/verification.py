"""`--verify` and `--verify-round-trip`: the stages around the push that prove what the servers
hold (the HTTP contract and the hashing are in ckptctl/weights_checker.py): check_offers,
start_hashing and round_trip_reset before the push, check_weights after it.

Only group leaders talk to servers; the rest travels between the ranks (`_share`): over a
serve job's own group, else through the job's store.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptctl.errors import OperationFailed
from ckptctl.job.groups import GroupAssignment
from ckptctl.job.runner import Job
from ckptctl.settings import Verify

if TYPE_CHECKING:
    from ckptctl.ce import ParameterServerSession
    from ckptctl.transfer.host_memory import ShareReader


@dataclass
class Verification:
    """How this job verifies, decided alike on every rank."""

    how: Verify
    servers: int
    hasher: Any = None  # weights_checker.BackgroundHasher, for Verify.checksum
    details: dict[str, Any] = field(default_factory=dict)


def _checker(job: Job, assignment: GroupAssignment) -> Any:
    from ckptctl.weights_checker import Checker

    assert assignment.address is not None
    return Checker(assignment.address, deadline=time.monotonic() + job.watchdog.remaining())


def _share(job: Job, key: str, doc: dict[str, Any], *, wanted: bool = True) -> list[dict[str, Any]]:
    """Every rank's `doc` (in rank order) where `wanted`; every rank must call it. A serve
    push's go over its group: what they prove is what the push reports."""
    if job.exchange is not None:
        return job.exchange(key, doc)
    return job.gather(key, doc, collect=wanted) or []


def check_offers(
    job: Job,
    assignment: GroupAssignment,
    ways: tuple[Verify, ...],
    *,
    hashes: bool = True,
) -> Verification:
    """Ask every server what it offers and decide which of `ways` to verify by (InvalidInput
    if none). hashes: whether this job registered tensors it could hash (not join)."""
    from ckptctl.weights_checker import COMPARE_CHECKSUM, VERIFY_HOWS, plan_verification, probe

    with job.reporter.stage("checker", "asking the servers' weights checkers") as st:
        mine: dict[str, Any] = {}
        if assignment.is_leader:
            checker = _checker(job, assignment)
            mine = {"where": checker.where, "offers": probe(checker)}
        docs = [d for d in _share(job, "verify-offers", mine) if d]
        offers = [(d["where"], list(d["offers"])) for d in docs]
        if not hashes:  # join: nothing registered here to hash
            offers = [(w, [a for a in acts if a != COMPARE_CHECKSUM]) for w, acts in offers]
        how = Verify(plan_verification(offers, round_trip=Verify.round_trip in ways))
        st.detail = f"{len(offers)} server(s): will check {VERIFY_HOWS[how]}"
    return Verification(how, len(offers))


def start_hashing(
    job: Job,
    session: ParameterServerSession,
    name: str,
    verification: Verification,
    reader: ShareReader | None = None,
) -> None:
    """For compare_checksum: hash this rank's registered tensors while the update runs, once
    `reader` (which may still be filling them: overlap.py) has read them."""
    if verification.how is not Verify.checksum:
        return
    from ckptctl.weights_checker import BackgroundHasher, hashing_threads

    threads = hashing_threads(job.launch.local_world_size)
    ready = None if reader is None else reader.wait_read
    hasher = BackgroundHasher(session.registered_bytes(name), threads, ready=ready)
    verification.hasher = hasher.start()


def round_trip_reset(job: Job, assignment: GroupAssignment, verification: Verification) -> None:
    """Every server snapshots its weights; only once all have does any of them reset."""
    if verification.how is not Verify.round_trip:
        return
    with job.reporter.stage("round_trip", "snapshotting, then resetting the served weights"):
        checker = _checker(job, assignment) if assignment.is_leader else None
        if checker is not None:
            checker.require("snapshot")
        job.barrier("verify-snapshot")
        if checker is not None:
            try:
                checker.require("reset_tensors")
            except OperationFailed as exc:
                raise OperationFailed(
                    f"{exc} (servers already reset serve random weights until an update lands)"
                ) from None
        job.barrier("verify-reset")


def check_weights(
    job: Job,
    assignment: GroupAssignment,
    verification: Verification,
    tensor_names: set[str] | None = None,
) -> dict[str, Any]:
    """After the push: prove it. Returns what was verified (complete on rank 0)."""
    from ckptctl.weights_checker import VERIFY_HOWS

    how = verification.how
    with job.reporter.stage("check_weights", f"checking {VERIFY_HOWS[how]}") as st:
        if how is Verify.checksum:
            st.detail = _check_sha256(job, assignment, verification, tensor_names or set())
        elif how is Verify.per_server:
            st.detail = _check_agreement(job, assignment, verification)
        else:
            st.detail = _check_round_trip(job, assignment, verification)
    return {"how": how.value, "server_count": verification.servers, **verification.details}


def _check_sha256(
    job: Job, assignment: GroupAssignment, verification: Verification, tensor_names: set[str]
) -> str:
    """Each rank's SHA-256s reach every leader, which sends the whole set to its server."""
    from ckptctl.weights_checker import check_expected

    hasher = verification.hasher
    assert hasher is not None
    waited = time.perf_counter()
    mine = hasher.result(timeout=job.watchdog.remaining())
    waited = time.perf_counter() - waited
    docs = _share(job, "verify-weights", {"sha256": mine}, wanted=assignment.is_leader)
    details = verification.details
    details.update(
        hash_seconds=round(hasher.seconds, 4),
        hash_waited_seconds=round(waited, 4),
        hash_threads=hasher.threads,
        hashed_bytes=hasher.nbytes,
    )
    hashed = (
        f"hashed {hasher.nbytes / 1e9:.2f} GB in {hasher.seconds:.2f}s on {hasher.threads} "
        f"thread(s), {waited:.2f}s of it after the update"
    )
    if not assignment.is_leader:
        details["tensor_count"] = len(mine)
        return hashed
    expected: dict[str, str] = {}
    for doc in docs:
        expected.update(doc["sha256"])
    missing = sorted(tensor_names - set(expected))
    if missing:
        raise OperationFailed(
            f"--verify: {len(missing)} tensor(s) of the checkpoint were never hashed "
            f"(not registered by any rank?): {', '.join(missing[:10])}"
        )
    check_expected(_checker(job, assignment), expected)
    details["tensor_count"] = len(expected)
    return f"{len(expected)} tensors match; {hashed}"


def _check_agreement(job: Job, assignment: GroupAssignment, verification: Verification) -> str:
    """Every leader reads its server's checksums; rank 0 compares them all."""
    from ckptctl.weights_checker import CHECKSUM, ServerChecksums, compare_servers, parse_checksums

    mine: dict[str, Any] = {}
    if assignment.is_leader:
        checker = _checker(job, assignment)
        answer = checker.require(CHECKSUM)
        report = parse_checksums(answer.doc or {}, checker.where)
        mine = {"where": checker.where, "report": report.as_json()}
    docs = [d for d in _share(job, "verify-weights", mine, wanted=job.launch.rank == 0) if d]
    if job.launch.rank != 0:
        return "checksums sent to rank 0" if mine else ""
    reports = [(d["where"], ServerChecksums.from_json(d["report"])) for d in docs]
    problems = compare_servers(reports)
    if problems:
        raise OperationFailed(
            "servers given the same checkpoint hold different weights (SGLang's parameter "
            "names, per rank): " + "; ".join(problems)
        )
    first = reports[0][1]
    verification.details.update(
        engine_checksum=first.digest(),
        ranks_per_server=len(first.ranks),
        parameters_per_server=sum(len(s) for s in first.ranks.values()),
    )
    return f"{len(reports)} servers agree ({first.digest()[:16]})"


def _check_round_trip(job: Job, assignment: GroupAssignment, verification: Verification) -> str:
    """Every leader has its server compare with the snapshot it took before the reset."""
    from ckptctl.weights_checker import round_trip_compare

    verification.details["scope"] = "TP rank 0 of each server (only it answers SGLang's compare)"
    if not assignment.is_leader:
        return ""
    round_trip_compare(_checker(job, assignment))
    return "the server holds what it was started with"
