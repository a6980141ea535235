from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos", "logprobs", "repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "min_p", "grammar", "no_speculation", "prediction_ids")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    NO_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    PREDICTION_IDS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    min_p: float
    grammar: Grammar
    no_speculation: bool
    prediction_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., min_p: _Optional[float] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., no_speculation: _Optional[bool] = ..., prediction_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("json_schema", "lark")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    LARK_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    lark: str
    def __init__(self, json_schema: _Optional[str] = ..., lark: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_ids", "generated_ids", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., generated_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class Token(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("tokens", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "num_accepted_prediction_tokens", "num_rejected_prediction_tokens")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_REJECTED_PREDICTION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedCompositeFieldContainer[Token]
    finish_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_accepted_prediction_tokens: int
    num_rejected_prediction_tokens: int
    def __init__(self, tokens: _Optional[_Iterable[_Union[Token, _Mapping]]] = ..., finish_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_accepted_prediction_tokens: _Optional[int] = ..., num_rejected_prediction_tokens: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_ids", "sampling", "lease_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    lease_id: str
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., lease_id: _Optional[str] = ...) -> None: ...

class PrefillResult(_message.Message):
    __slots__ = ("first_token", "kv_handle", "num_prompt_tokens", "num_cached_tokens", "kv_layout", "kv_bytes", "finish_reason", "lease_ttl_s")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    first_token: Token
    kv_handle: str
    num_prompt_tokens: int
    num_cached_tokens: int
    kv_layout: str
    kv_bytes: int
    finish_reason: str
    lease_ttl_s: float
    def __init__(self, first_token: _Optional[_Union[Token, _Mapping]] = ..., kv_handle: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., kv_layout: _Optional[str] = ..., kv_bytes: _Optional[int] = ..., finish_reason: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ...) -> None: ...

class FetchKVRequest(_message.Message):
    __slots__ = ("kv_handle",)
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    def __init__(self, kv_handle: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("layer", "first_token", "num_tokens", "data", "checksum", "kv_layout", "token_ids", "num_chunks")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first_token: int
    num_tokens: int
    data: bytes
    checksum: int
    kv_layout: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_chunks: int
    def __init__(self, layer: _Optional[int] = ..., first_token: _Optional[int] = ..., num_tokens: _Optional[int] = ..., data: _Optional[bytes] = ..., checksum: _Optional[int] = ..., kv_layout: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., num_chunks: _Optional[int] = ...) -> None: ...

class ReleaseKVRequest(_message.Message):
    __slots__ = ("kv_handle", "lease_id")
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    kv_handle: str
    lease_id: str
    def __init__(self, kv_handle: _Optional[str] = ..., lease_id: _Optional[str] = ...) -> None: ...

class ReleaseKVResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KVSource(_message.Message):
    __slots__ = ("address", "kv_handle")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    address: str
    kv_handle: str
    def __init__(self, address: _Optional[str] = ..., kv_handle: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "model", "prompt_ids", "generated_ids", "sampling", "kv_source")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    generated_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_source: KVSource
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., generated_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_source: _Optional[_Union[KVSource, _Mapping]] = ...) -> None: ...

class SessionOpen(_message.Message):
    __slots__ = ("id", "generate", "decode", "timeout_s", "traceparent", "tracestate")
    ID_FIELD_NUMBER: _ClassVar[int]
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    id: int
    generate: GenerateRequest
    decode: DecodeRequest
    timeout_s: float
    traceparent: str
    tracestate: str
    def __init__(self, id: _Optional[int] = ..., generate: _Optional[_Union[GenerateRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., timeout_s: _Optional[float] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("open", "cancel")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    open: _containers.RepeatedCompositeFieldContainer[SessionOpen]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, open: _Optional[_Iterable[_Union[SessionOpen, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class SessionError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionItem(_message.Message):
    __slots__ = ("id", "chunk", "error", "finished")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    id: int
    chunk: TokenChunk
    error: SessionError
    finished: bool
    def __init__(self, id: _Optional[int] = ..., chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., error: _Optional[_Union[SessionError, _Mapping]] = ..., finished: _Optional[bool] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[SessionItem]
    def __init__(self, items: _Optional[_Iterable[_Union[SessionItem, _Mapping]]] = ...) -> None: ...

class EmbedInput(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "model", "inputs", "dimensions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    inputs: _containers.RepeatedCompositeFieldContainer[EmbedInput]
    dimensions: int
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[EmbedInput, _Mapping]]] = ..., dimensions: _Optional[int] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("data", "num_prompt_tokens", "num_cached_tokens")
    DATA_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    num_prompt_tokens: int
    num_cached_tokens: int
    def __init__(self, data: _Optional[bytes] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings", "normalized")
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    NORMALIZED_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    normalized: bool
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ..., normalized: _Optional[bool] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "tokenizer_json", "tokenizer_config_json", "chat_template", "generation_config_json", "context_length", "vocab_size", "block_size", "kv_bytes_per_token", "eos_token_ids")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    model: str
    tokenizer_json: str
    tokenizer_config_json: str
    chat_template: str
    generation_config_json: str
    context_length: int
    vocab_size: int
    block_size: int
    kv_bytes_per_token: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., tokenizer_json: _Optional[str] = ..., tokenizer_config_json: _Optional[str] = ..., chat_template: _Optional[str] = ..., generation_config_json: _Optional[str] = ..., context_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("status", "site", "models", "kv_blocks_total", "kv_blocks_free", "num_running", "num_waiting", "num_kv_leases", "kv_data_port")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        SERVING: _ClassVar[HealthResponse.Status]
        DRAINING: _ClassVar[HealthResponse.Status]
        NOT_SERVING: _ClassVar[HealthResponse.Status]
    SERVING: HealthResponse.Status
    DRAINING: HealthResponse.Status
    NOT_SERVING: HealthResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    SITE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_LEASES_FIELD_NUMBER: _ClassVar[int]
    KV_DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    status: HealthResponse.Status
    site: str
    models: _containers.RepeatedScalarFieldContainer[str]
    kv_blocks_total: int
    kv_blocks_free: int
    num_running: int
    num_waiting: int
    num_kv_leases: int
    kv_data_port: int
    def __init__(self, status: _Optional[_Union[HealthResponse.Status, str]] = ..., site: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_kv_leases: _Optional[int] = ..., kv_data_port: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("deadline_s",)
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    deadline_s: float
    def __init__(self, deadline_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("draining", "num_inflight")
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    draining: bool
    num_inflight: int
    def __init__(self, draining: _Optional[bool] = ..., num_inflight: _Optional[int] = ...) -> None: ...
