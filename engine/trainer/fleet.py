"""Several engines, one update: the rank layout of one collective group across engines (vLLM's: the trainer is
rank 0, engine i's workers start at rank_offset_i = 1 + the workers of the engines before it), the checks that
refuse a fleet before any transfer begins, the two phases of its finish (every engine verifies, then every
engine commits), and running one HTTP step on every engine at once.

Pure except `fan_out` / `fan_out_settled`, which only run the caller's calls on threads; the trainer client
(engine.trainer.client.WeightSyncClient) does the HTTP.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
PREFLIGHT_TIMEOUT_S = 5.0  # an engine that does not answer /weight_info in this long is refused


class FleetError(ValueError):
    """A fleet refused before any transfer began; the message names the engine."""


def engine_urls(base_url: str | Sequence[str] | None) -> list[str]:
    """One URL or several; several must be distinct (one engine twice would claim its ranks twice)."""
    if base_url is None:
        return []
    urls = [base_url] if isinstance(base_url, str) else list(base_url)
    if not urls or not all(isinstance(u, str) and u for u in urls):
        raise FleetError(f"base_url must be a URL or a non-empty list of URLs, got {base_url!r}")
    urls = [u.rstrip("/") for u in urls]
    seen: set[str] = set()
    for u in urls:
        if u in seen:
            raise FleetError(f"engine {u} is listed twice")
        seen.add(u)
    return urls


def rank_offsets(urls: Sequence[str], world_sizes: Sequence[Any]) -> tuple[list[int], int]:
    """Each engine's rank_offset and the group's world size (trainer + every engine's workers)."""
    offsets, rank = [], 1
    for url, n in zip(urls, world_sizes, strict=True):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise FleetError(f"engine {url}: /get_world_size answered {n!r}, not a positive number of workers")
        offsets.append(rank)
        rank += n
    return offsets, rank


def check_versions(urls: Sequence[str], versions: Sequence[Any]) -> None:
    """Every engine on the same weight version, else the odd ones out are named."""
    counts: dict[Any, int] = {}
    for v in versions:
        counts[v] = counts.get(v, 0) + 1
    if len(counts) <= 1:
        return
    common = max(counts, key=lambda v: (counts[v], v == versions[0]))
    odd = [f"engine {u} is on weight version {v!r}" for u, v in zip(urls, versions) if v != common]
    raise FleetError(f"{'; '.join(odd)}, the others on {common!r}: update engines on one version together "
                     "(send the same weights to each alone first)")


def verify_body(version: str | None) -> dict[str, Any]:
    """Phase one of a fleet's finish: the engine checks that every worker holds its part, commits nothing."""
    return {"commit": False, **({"weight_version": version} if version else {})}


def commit_failure(failed: Sequence[tuple[str, BaseException]], committed: Sequence[str], version: str | None
                   ) -> str:
    """Phase two failed on some engines after every engine verified the update: which, why, and where the
    fleet stands (the next update is refused until every engine is on one version again)."""
    why = "; ".join(str(e) if url in str(e) else f"engine {url}: {e}" for url, e in failed)
    where = (f"engines {', '.join(committed)} committed {version or 'the update'}" if committed
             else "no engine committed")
    return (f"commit failed after every engine verified the update: {why}; {where}. The next update is "
            "refused until every engine reports one weight version")


def fan_out_settled(urls: Sequence[str], call: Callable[[str], T]) -> list[T | BaseException]:
    """call(url) on every engine at once; each engine's result or exception, in order."""
    with ThreadPoolExecutor(max(1, len(urls))) as pool:
        futures = [pool.submit(call, u) for u in urls]
        return [f.exception() or f.result() for f in futures]


def fan_out(urls: Sequence[str], call: Callable[[str], T]) -> list[T]:
    """call(url) on every engine at once; all of them run to the end. Raises the first failure, its message
    joined with every other engine's failure (each names its engine)."""
    if len(urls) == 1:
        return [call(urls[0])]
    outcomes = fan_out_settled(urls, call)
    failed = [e for e in outcomes if isinstance(e, BaseException)]
    if failed:
        first = failed[0]
        if len(failed) > 1 and hasattr(first, "status"):
            raise type(first)("; ".join(str(e) for e in failed), first.status) from first
        raise first
    return outcomes  # type: ignore[return-value]
