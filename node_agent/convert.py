"""Translation between the agent protos and the engine's types. No I/O, no policy."""

from __future__ import annotations

from engine.async_engine import TokenEvent
from engine.grammar import GrammarSpec
from engine.sampling import SamplingParams
from node_agent.proto import agent_pb2


def sampling_from_proto(msg: agent_pb2.SamplingParams) -> SamplingParams:
    # An unset message means "defaults", except max_tokens, which proto3 cannot tell from 0.
    return SamplingParams(
        max_tokens=msg.max_tokens,
        temperature=msg.temperature,
        top_k=msg.top_k,
        top_p=msg.top_p if msg.top_p else 1.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=list(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        repetition_penalty=msg.repetition_penalty or 1.0,
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        logit_bias=dict(msg.logit_bias),
        min_p=msg.min_p,
        grammar=grammar_from_proto(msg.grammar) if msg.HasField("grammar") else None,
        no_speculation=msg.no_speculation,
        prediction_ids=list(msg.prediction_ids),
    )


def grammar_from_proto(msg: agent_pb2.Grammar) -> GrammarSpec | None:
    kind = msg.WhichOneof("source")
    return GrammarSpec(kind, getattr(msg, kind)) if kind else None


def grammar_to_proto(spec: GrammarSpec) -> agent_pb2.Grammar:
    return agent_pb2.Grammar(**{spec.kind: spec.source})


def sampling_to_proto(params: SamplingParams) -> agent_pb2.SamplingParams:
    msg = agent_pb2.SamplingParams(max_tokens=params.max_tokens, temperature=params.temperature,
                                   top_k=params.top_k, top_p=params.top_p, stop_token_ids=params.stop_token_ids,
                                   ignore_eos=params.ignore_eos, repetition_penalty=params.repetition_penalty,
                                   presence_penalty=params.presence_penalty,
                                   frequency_penalty=params.frequency_penalty, logit_bias=params.logit_bias,
                                   min_p=params.min_p, no_speculation=params.no_speculation,
                                   prediction_ids=params.prediction_ids)
    if params.grammar is not None:
        msg.grammar.CopyFrom(grammar_to_proto(params.grammar))
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def token_to_proto(event: TokenEvent) -> agent_pb2.Token:
    token = agent_pb2.Token(token_id=event.token_id)
    if event.logprob is not None:
        token.logprob = event.logprob
    for token_id, logprob in event.top_logprobs or ():
        token.top_logprobs.add(token_id=token_id, logprob=logprob)
    return token


def token_chunk(events: list[TokenEvent], chunk: agent_pb2.TokenChunk | None = None) -> agent_pb2.TokenChunk:
    """One stream message: the tokens one step made for a request (a speculative step's accepted tokens),
    or that queued while the reader was behind; the counts are the last event's (the prediction counts
    are every event's: a message never spans a change of them, engine.async_engine.TokenEvent.more).
    Only fields that differ from proto3's defaults are set (a keyword per field costs the relay of every token).
    `chunk`: an empty message to fill in place (a session batch's item), rather than a new one."""
    last = events[-1]
    if chunk is None:
        chunk = agent_pb2.TokenChunk(num_prompt_tokens=last.num_prompt_tokens)
    else:
        chunk.num_prompt_tokens = last.num_prompt_tokens
    if last.finish_reason:
        chunk.finish_reason = last.finish_reason
    if last.num_cached_tokens:
        chunk.num_cached_tokens = last.num_cached_tokens
    if last.num_accepted_prediction_tokens:
        chunk.num_accepted_prediction_tokens = last.num_accepted_prediction_tokens
    if last.num_rejected_prediction_tokens:
        chunk.num_rejected_prediction_tokens = last.num_rejected_prediction_tokens
    tokens = chunk.tokens
    for event in events:
        if event.logprob is None and not event.top_logprobs:
            tokens.add(token_id=event.token_id)
        else:
            tokens.append(token_to_proto(event))
    return chunk
