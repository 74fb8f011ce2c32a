"""The job contract: what a request is on the wire and the rules it must keep. No torch,
no Redis; of the project it imports only runtime/ (its settings and the model's files).

protocol.py            every message kind and `decode`; re-exports the next four's kinds
heartbeat.py           `Heartbeat`: a worker's load and what it serves, under a key with a TTL
requests.py            the jobs: `GenerateRequest`, `TokenizedRequest`, `Abort`, their
                       version (`v`) and where `priority` travels
token_records.py       a worker's `TokenItem` and `Finish`, records by name (wire version 2)
token_batch.py         `TokenBatch`: a worker's step, one item a request; an item that does
                       not read is named apart, not the batch's failure
legacy_records.py      version 1's positional lists, still read, and written to its readers
progress.py            a worker's progress log entries, and a job's ids rebuilt from them
kv_blocks.py           the chained hashes naming a token sequence's blocks (KV routing)
kv_events.py           `KvEvents`: the blocks a worker's prefix cache stored and removed, and
                       its load then (`LoadReading`)
weights.py             the fleet's weights record: the version every worker should serve
wire.py                the codec: one msgpack map per entry, `Record`s, the wire version
sampling_params.py     `SamplingParams`, the one table of sampling parameters
sampling_checks.py     the type and range checks of its rows
request_normaliser.py  a request's prompt and parameters read alike by every door (the
                       engine's generate, the tokenizer stage, the worker): defaults, checks
chat_messages.py       a chat checked, and its tools placed, before its template renders it
model_tokenizer.py     a model's tokenizer files read without torch (tokenizers + jinja2):
                       the stages' and the engine's one tokenizer
request_bounds.py      the request bounds (docs/BOUNDS.md) this process applies
grammar.py             structured output's grammars, bounded and compiled under a deadline
strict_schema.py       JSON Schemas made strict: objects hold only their declared properties
field_error.py         `FieldError`: a bad value, with the field it is about
unicode_text.py        a user's JSON checked for lone surrogates: strings every encoder takes
errors.py              `RequestError`: a refused or failed request, on either side of the bus
job_failures.py        the error reply for a job that cannot be served
stop_strings.py        stop-string matching, shared by worker and detokenizer
tool_format.py         how tool calls look in the model's text (Hermes)
"""
