"""AgentEpisodes: a rollout's trajectories as episodes that outside agent programs drive (docs/architecture.md §14).

    run(a)       the trajectory's task: announce the episode to the gateway, wait for its end
                 (EndEpisode, a budget), with every call served meanwhile -> (finish reason, reward)
    on_call      AgentCall from the gateway: render the request, check it extends the recording,
                 generate (agent_call.py), record, make durable, answer (idempotent by call id)
    on_end       EndEpisode: the agent's reward, or none for the rollout's reward function
    announce     the episodes held here, to the gateway: new ones at once, all of them every
                 `announce_interval_s` (the gateway's table is rebuilt from these), ended ones

The recording (token-exact). The first call's rendered context becomes the trajectory's prompt
(`spec.prompt_tokens`; until then the trajectory is held back from the partial pool, `hold`).
Each later call's rendered context must extend, as text, the decoded recording (prompt + response
tokens): the new suffix is encoded once and appended as observation tokens (loss mask 0, logprob
0, one observation span per call, an empty one for the first), then choice 0's sampled tokens
with their logprobs (mask 1). The engine's context for the call is exactly the recorded tokens,
so the trajectory is what the engine saw and produced, never re-tokenized from text. An assistant
message the agent echoes back is rendered from the exact text the model sampled (matched by its
content and tool calls), so a template that would write it differently does not break the chain.
A context that still does not extend the recording is a history rewrite: refused (`rewritten`)
or, with `on_rewrite: segment`, the start of a new segment (agent_record.py: its whole context
appended as an observation; later calls extend that segment; both counted). A retry of the last
call (its context is the recording before that call's reply) is answered from the recording.

Versions and moves. The batch loop changes weights only when nothing is active, so every call of
an episode runs on the version it started on. An episode whose call is running, or that has had
no call yet (nothing of it is durable), stays here (`Active.busy`, `Active.hold`: MigrateOut
leaves it); between calls it moves like any trajectory, and its new rollout announces it.

Budgets: `max_calls` calls, the spec's token budget (observations included), `wall_s` from when
it was taken here. An episode never called ends `agent_failed` (stored, trains nothing).
"""
from __future__ import annotations

import asyncio
import dataclasses
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from laminar.bus.errors import PeerUnavailable, RemoteError
from laminar.bus.rpc import RequestError
from laminar.roles.rollout.agent_call import CallParams, CallRun
from laminar.roles.rollout.agent_config import RolloutAgentConfig
from laminar.roles.rollout.agent_record import calls, segment_start, turns
from laminar.roles.rollout.trajectory import Active

from laminar.chat import ChatError, ChatFormat, GrowingText, message_key
from laminar.datasets import load_tokenizer
from laminar.protocol import Ack, AgentCall, AgentCallReply, AnnounceEpisodes, EndEpisode, EpisodeInfo
from laminar.toolcalls import parse_tool_calls

POLL_S = 20.0  # longest a poll of a running call waits before answering with what there is


@dataclass
class Episode:
    a: Active
    opened: float = field(default_factory=time.monotonic)
    ended: asyncio.Future | None = None      # (finish reason, reward or None)
    call: CallRun | None = None              # the running call, or the last one
    call_task: asyncio.Task | None = None
    echoes: dict[str, str] = field(default_factory=dict)  # message_key -> the text the model sampled
    recording: GrowingText | None = None     # the decoded recording (the extension check's)


class AgentEpisodes:
    """The agent episodes of one rollout: their calls, their ends, their announcements."""

    def __init__(self, settings: RolloutAgentConfig, model_dir: str, engine, rollout_id: str, address: str,
                 gateway, make_durable, spawn, log, *, max_model_len: int, seed: int | None,
                 on_tokens=lambda n: None):
        self.s, self.engine, self.rollout_id, self.address = settings, engine, rollout_id, address
        self.gateway, self.make_durable, self.spawn, self.log = gateway, make_durable, spawn, log
        self.max_model_len, self.seed, self.on_tokens = max_model_len, seed, on_tokens
        tok_dir = settings.tokenizer_dir or model_dir
        self.fmt = ChatFormat.load(tok_dir, settings.chat_template)
        self.text_tok = load_tokenizer(tok_dir)   # the prompt pool's prompts, as text for the agent
        self.open: dict[str, Episode] = {}
        self.counts: Counter[str] = Counter()

    # -- an episode's life (the trajectory's task) -------------------------------------------------
    async def run(self, a: Active) -> tuple[str, float | None]:
        ep = self.open[a.id] = Episode(a, ended=asyncio.get_running_loop().create_future(),
                                       recording=GrowingText(self.fmt))
        self.held(a)
        if a.obs_spans:
            self._rebuild_echoes(ep)
        self.counts["opened"] += 1
        self.spawn(self._announce([ep]), f"announce:{a.id}", oneshot=True)
        try:
            left = self.s.wall_s - (time.monotonic() - ep.opened)
            try:
                reason, reward = await asyncio.wait_for(asyncio.shield(ep.ended), max(left, 0.0))
            except TimeoutError:
                reason, reward = ("timeout", None) if a.obs_spans else ("agent_failed", 0.0)
                self._end(ep, reason, reward)
            if ep.call_task is not None:
                await asyncio.shield(ep.call_task)  # a call still running is recorded before the end
        finally:
            # an ended episode stays until stored (release): a late call or end is answered `ended`;
            # one that leaves unended (moved away, stopped) is its new rollout's to announce
            if not ep.ended.done() and self.open.get(a.id) is ep:
                del self.open[a.id]
        if not a.obs_spans:
            reason, reward = "agent_failed", 0.0   # never called: nothing to train on
        self.counts["ended_" + reason] += 1
        return reason, reward

    @staticmethod
    def held(a: Active) -> None:
        """Nothing of a new episode is durable until its first call renders its prompt (set when it
        starts here, before anything can flush it; a resumed one, already durable, is not held)."""
        a.hold = a.next_seq == 0 and not a.obs_spans

    def _end(self, ep: Episode, reason: str, reward: float | None) -> None:
        if not ep.ended.done():
            ep.ended.set_result((reason, reward))

    async def release(self, tid: str, reason: str) -> None:
        """The trajectory is stored: forget the episode and tell the gateway it ended."""
        ep = self.open.pop(tid, None)
        if ep is not None:
            await self._announce([ep], state="failed" if reason == "agent_failed" else "ended")

    # -- requests from the gateway -----------------------------------------------------------------
    async def on_end(self, req: EndEpisode) -> Ack:
        ep = self._episode(req.episode_id)
        if ep.ended.done():
            return Ack(f"already ended ({ep.ended.result()[0]})")
        # the agent's end is a stop; its role's, after a killed or crashed run, keeps the why
        reason = {"failed": "agent_failed", "agent_killed": "agent_killed"}.get(req.reason, "stop")
        self._end(ep, reason, 0.0 if reason == "agent_failed" else req.reward)
        self.log.info("episode_end", episode=req.episode_id, reward=req.reward, reason=req.reason,
                      calls=calls(ep.a.obs_spans))
        return Ack("ended")

    async def on_call(self, req: AgentCall) -> AgentCallReply:
        ep = self._episode(req.episode_id)
        run = ep.call
        if run is not None and run.call_id == req.call_id:  # a poll of a streamed call, or a retry
            return await run.reply(req.offset, POLL_S)
        if run is not None and not run.done:
            raise RequestError("busy", f"episode {req.episode_id}: call {run.call_id} is still running")
        if ep.ended.done():
            raise RequestError("ended", f"episode {req.episode_id} is over ({ep.ended.result()[0]})")
        params = CallParams.parse(req.api, req.body)
        run = self._start_call(ep, req, params)
        return await run.reply(req.offset, POLL_S)

    def _episode(self, eid: str) -> Episode:
        ep = self.open.get(eid)
        if ep is None or ep.a.fenced:
            raise RequestError("not_here", f"rollout {self.rollout_id} does not hold episode {eid!r}")
        return ep

    # -- one call ------------------------------------------------------------------------------------
    def _start_call(self, ep: Episode, req: AgentCall, p: CallParams) -> CallRun:
        """Render, check and budget the call, then run it as its own task (synchronous up to there:
        nothing else touches the episode in between)."""
        a = ep.a
        text, ids = self._context(ep, p)
        # nothing recorded yet (held): this call's context becomes the prompt; otherwise it must extend
        # the recording (an episode restarted from its durable prompt starts from that prompt)
        recorded = [] if a.hold else np.asarray(a.spec.prompt_tokens).tolist() + a.tokens
        obs, rewrite = self._extension(ep, text, ids, recorded, p, req)
        if isinstance(obs, CallRun):  # the last call, retried
            ep.call = obs
            return obs
        if calls(a.obs_spans) >= self.s.max_calls:
            self._end(ep, "turns", None)
            raise RequestError("ended", f"episode {a.id}: its {self.s.max_calls} calls are spent")
        context = recorded + obs
        budget = min(p.max_tokens or self.s.default_max_tokens, a.remaining - (len(obs) if recorded else 0),
                     self.max_model_len - len(context))
        if budget <= 0:
            self._end(ep, "length", None)
            raise RequestError("ended", f"episode {a.id}: its token budget is spent ({len(a.tokens)} of "
                                        f"{a.spec.max_tokens} response tokens, context {len(context)})")
        run = CallRun(req.call_id, p, context, self.fmt, a.version, a.lineage, a.id, req.stream, budget)
        run.rewrite = rewrite
        ep.call, a.busy = run, True
        ep.call_task = self.spawn(self._run_call(ep, run, obs if recorded else []), f"call:{a.id}", oneshot=True)
        return run

    def _context(self, ep: Episode, p: CallParams) -> tuple[str | None, list[int] | None]:
        """The call's context as text (chat, text completions) or as token ids (completions)."""
        try:
            if p.api == "chat":
                msgs = [self._echo(ep, m) for m in p.messages]
                extra = {"tool_choice": p.tool_choice} if p.tool_choice not in (None, "none") else {}
                return self.fmt.render(msgs, p.tools, **extra), None
        except ChatError as exc:
            raise RequestError("bad_request", str(exc)) from None
        if isinstance(p.prompt, str):
            return p.prompt, None
        return None, [int(t) for t in p.prompt]

    def _echo(self, ep: Episode, m) -> dict:
        """An assistant message this episode returned, as the exact text the model sampled."""
        if isinstance(m, dict) and m.get("role") == "assistant":
            raw = ep.echoes.get(message_key(m))
            if raw is not None:
                return {"role": "assistant", "content": raw}
        return m

    def _extension(self, ep: Episode, text, ids, recorded: list[int], p: CallParams, req: AgentCall):
        """(observation tokens, new segment?) of a call: all of its context on the first call, the part
        past the current segment's tokens after that; or the CallRun of a retried last call."""
        if not recorded:
            return (self.fmt.encode(text) if ids is None else ids), False
        a = ep.a
        seg = segment_start(a.obs_spans)
        base = recorded if seg is None else a.tokens[seg:]   # what the call's context must extend
        if ids is not None:
            if ids[:len(base)] == base:
                return ids[len(base):], False
        else:
            done = ep.recording.decode(base, seg)  # it only grows: decoded anew from its last special token
            if text.startswith(done):
                return self.fmt.encode(text[len(done):]), False
        if a.obs_spans:  # the context the last call saw: a retry of it
            end = a.obs_spans[-1][1]
            seen = base[:(len(a.spec.prompt_tokens) + end) if seg is None else end - seg]
            if (ids == seen) if ids is not None else (text == self.fmt.decode(seen)):
                return self._replay(ep, p, req, recorded[:len(a.spec.prompt_tokens) + end]), False
        self.counts["history_rewrites"] += 1
        self.log.warning("history_rewritten", episode=a.id, calls=calls(a.obs_spans), policy=self.s.on_rewrite)
        if self.s.on_rewrite == "segment":  # its whole context starts a new segment of the episode
            self.counts["segments"] += 1
            return (self.fmt.encode(text) if ids is None else ids), True
        raise RequestError("rewritten", f"episode {a.id}: the call's context does not extend the "
                                        f"{len(base)} tokens recorded so far (history rewritten); continue "
                                        "from the conversation as returned, or start a new episode")

    def _replay(self, ep: Episode, p: CallParams, req: AgentCall, before: list[int]) -> CallRun:
        a = ep.a
        start = a.obs_spans[-1][1]
        self.counts["replayed_calls"] += 1
        return CallRun.replay(req.call_id, p, before, a.tokens[start:], a.logprobs[start:], self.fmt, a.version,
                              a.lineage, a.id)

    async def _run_call(self, ep: Episode, run: CallRun, obs: list[int]) -> None:
        """Generate, record choice 0, make it durable, then let the reply go."""
        a = ep.a
        seed = run.params.seed
        if seed is None and self.seed is not None:
            seed = zlib.crc32(f"{self.seed}:{a.id}:{len(a.tokens)}".encode())
        rid = f"{a.id}#{self.rollout_id}.{a.attempt}.c{len(a.obs_spans)}.{run.call_id[:8]}"
        try:
            await run.generate(self.engine, rid, seed)
            self._record(ep, run, obs)
            await self.make_durable(a)
            if a.fenced:
                raise RequestError("not_here", f"episode {a.id} was taken over by another rollout")
            run.finish()
        except RequestError as exc:
            run.fail(exc)
        except Exception as exc:  # noqa: BLE001 - an engine failure fails this call, not the rollout
            self.log.error("agent_call_failed", episode=a.id, call=run.call_id, error=repr(exc))
            run.fail(RequestError("internal", f"episode {a.id}: the call failed: {exc!r}"))
        finally:
            a.busy = False
            ep.call_task = None
        self.counts["calls"] += 1
        if a.remaining <= 0:
            self._end(ep, "length", None)
        elif calls(a.obs_spans) >= self.s.max_calls:
            self._end(ep, "turns", None)

    def _record(self, ep: Episode, run: CallRun, obs: list[int]) -> None:
        a, c = ep.a, run.choices[0]
        if not c.tokens:
            return  # nothing sampled (an aborted request): nothing to record, the call is as if unmade
        if a.hold:  # the first call: its context is the trajectory's prompt (the hand-out covers the pool's)
            handed = a.spec.prompt_tokens if a.spec.handed_prompt is None else a.spec.handed_prompt
            a.spec = dataclasses.replace(a.spec, prompt_tokens=np.asarray(run.context, np.int32), handed_prompt=handed)
            a.hold = False
        if run.rewrite:
            a.add_observation([])  # the marker of a new segment (agent_record.py)
        a.add_observation(obs)
        a.add_generated(c.tokens, c.logprobs)
        self.on_tokens(sum(len(x.tokens) for x in run.choices))
        raw = c.tokens[:-1] if c.tokens and c.tokens[-1] == self.fmt.eos_id else c.tokens
        content, found = parse_tool_calls(c.text) if c.tools is not None else (c.text, [])
        key = message_key({"content": content, "tool_calls": [{"function": x} for x in found]})
        ep.echoes[key] = self.fmt.decode(raw)

    def _rebuild_echoes(self, ep: Episode) -> None:
        """After a move: each recorded turn's text, by the message a client would echo for it."""
        a = ep.a
        for start, end in turns(a.obs_spans, len(a.tokens)):
            toks = a.tokens[start:end]
            raw = toks[:-1] if toks and toks[-1] == self.fmt.eos_id else toks
            content, found = parse_tool_calls(self.fmt.display(raw))
            ep.echoes[message_key({"content": content, "tool_calls": [{"function": x} for x in found]})] = \
                self.fmt.decode(raw)

    # -- announcements ------------------------------------------------------------------------------
    def _info(self, ep: Episode, state: str = "open") -> EpisodeInfo:
        a = ep.a
        return EpisodeInfo(episode_id=a.id, version=a.version, lineage=a.lineage, prompt=self._prompt_text(a),
                           group_id=a.spec.group_id, sample_index=a.spec.sample_index, calls=calls(a.obs_spans),
                           tokens=len(a.tokens), state=state)

    def _prompt_text(self, a: Active) -> str:
        return self.text_tok.decode(a.spec.prompt_tokens) if not a.obs_spans else ""

    async def _announce(self, eps: list[Episode], state: str = "open", full: bool = False) -> bool:
        try:
            await self.gateway.call(AnnounceEpisodes(self.rollout_id, self.address,
                                                     [self._info(e, state) for e in eps], full=full),
                                    timeout=self.s.rpc_timeout_s)
            return True
        except (PeerUnavailable, RemoteError) as exc:  # the periodic announcement repeats it
            self.counts["announce_failures"] += 1
            self.log.warning("announce_failed", episodes=len(eps), error=str(exc))
            return False

    async def announce_loop(self) -> None:
        """The `announce` task: every episode held here, every announce_interval_s."""
        while True:
            await asyncio.sleep(self.s.announce_interval_s)  # the announcement period
            await self._announce([e for e in self.open.values() if not e.ended.done()], full=True)

    def status(self) -> dict:
        return {"agent_episodes": len(self.open), **{f"agent_{k}": v for k, v in self.counts.items()}}
