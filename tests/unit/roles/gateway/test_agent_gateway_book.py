"""The gateway's episode table (roles/gateway/book.py) and its metrics, without a server:

- an announced episode is claimable once, only while its rollout is heard from; one announced
  with calls already made is an agent's (after a gateway restart) and is never handed out again;
- a full announcement that no longer names an episode makes it lost: a call waiting for it wakes
  when another rollout announces it (moved), and the move is counted;
- an episode nobody announces for `lost_after_s` fails (a late call: `failed`); when a rollout
  turns out to hold it after all, the gateway names it to be ended as failed there;
- ended episodes are remembered (bounded) and counted; the status has the counters and the
  latency percentiles, and a node's Prometheus exposition and live view show them.
"""
from __future__ import annotations

import asyncio
import time

from laminar.roles.gateway.book import EpisodeBook

from laminar.health import HealthCollector
from laminar.live import LiveView
from laminar.protocol import AnnounceEpisodes, EpisodeInfo, Heartbeat


def info(eid: str, calls: int = 0, state: str = "open", version: int = 3) -> EpisodeInfo:
    return EpisodeInfo(episode_id=eid, version=version, prompt=f"p {eid}", calls=calls, state=state)


def announce(book: EpisodeBook, rollout: str, *eps: EpisodeInfo, full: bool = False) -> list[str]:
    return book.announce(AnnounceEpisodes(rollout, f"tcp://{rollout}", list(eps), full=full))


def test_claims_moves_and_ends():
    async def main():
        book = EpisodeBook(lost_after_s=60, stale_after_s=5, remember_ended=2)
        announce(book, "r0", info("a"), info("b"), info("c", calls=2))
        first, second = book.claim(), book.claim()
        assert (first.id, second.id, book.claim()) == ("a", "b", None)  # c is an agent's already
        assert book.rows["c"].claimed and book.status()["episodes_active"] == 3

        waiting = asyncio.ensure_future(book.wait_moved(first, 5))
        announce(book, "r0", info("b"), info("c", calls=2), full=True)     # a left r0 (a repack)
        await asyncio.sleep(0)
        assert book.rows["a"].rollout_id is None and not waiting.done()
        announce(book, "r1", info("a", calls=1))
        assert await waiting and book.rows["a"].address == "tcp://r1" and book.counts["episodes_moved"] == 1

        for e in ("a", "b", "c"):
            announce(book, "r1", info(e, state="ended" if e != "c" else "failed"))
        assert book.state_of("a") is None and book.state_of("c") == "failed"  # only the newest 2 remembered
        s = book.status()
        assert (s["episodes_finished"], s["episodes_failed"], s["episodes_open"]) == (2, 1, 0)
    asyncio.run(main())


def test_a_silent_rollout_s_episodes_fail_and_are_ended_where_they_turn_up():
    book = EpisodeBook(lost_after_s=0.05, stale_after_s=0.01, remember_ended=16)
    announce(book, "r0", info("a"), info("b", calls=1))
    time.sleep(0.06)
    assert book.claim() is None                                  # r0 went silent: nothing handed out
    assert sorted(book.expire()) == ["a", "b"] and book.state_of("b") == "failed"
    assert announce(book, "r1", info("b", calls=1)) == ["b"]     # adopted late: to be ended as failed
    assert "b" not in book.rows


def test_gateway_metrics_in_prometheus_and_the_live_view():
    book = EpisodeBook(60, 5, 16)
    announce(book, "r0", info("a"))
    book.claim()
    book.counts.update({"calls": 4, "episodes_called": 2, "history_rewrites": 1})
    book.latency.extend([0.1, 0.2, 0.3, 2.0])
    book.call_tokens.extend([10, 30])
    status = book.status()
    assert status["calls_per_episode"] == 2.0 and status["tokens_per_call"] == 20.0
    assert status["latency_p50_s"] == 0.3 and status["latency_p99_s"] == 2.0
    c = HealthCollector("run", "h0", {"gateway.0": "h0"}, dead_after_s=5.0)
    c.observe(Heartbeat(role="gateway", id="0", host="h0", pid=1, seq=1, uptime_s=1.0, state="ready", status=status))
    text = c.exposition()
    for line in ('laminar_gateway_calls_total{id="0",host="h0"} 4',
                 'laminar_gateway_episodes_active{id="0",host="h0"} 1',
                 'laminar_gateway_latency_p99_seconds{id="0",host="h0"} 2',
                 'laminar_gateway_history_rewrites_total{id="0",host="h0"} 1'):
        assert line in text, line
    row = LiveView.facts(c.every_role()["gateway.0"])
    assert "episodes 1/1" in row and "calls 4" in row and "rewrites 1" in row
