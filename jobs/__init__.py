"""The job contract: what a request is on the wire and the rules it must keep. No torch,
no Redis.

protocol.py         every message kind, its fields' wire types, and `decode`
wire.py             the codec under them: one msgpack map per entry, token ids packed int32
sampling_params.py  `SamplingParams`, the one table of sampling parameters
sampling_checks.py  the type and range checks of its rows
request_bounds.py   the request bounds (docs/BOUNDS.md) this process applies
field_error.py      `FieldError`: a bad value, with the field it is about
request_normaliser.py  a request's prompt and parameters read alike by every door (the
                    engine's generate, the tokenizer stage, the worker): defaults and checks
chat_messages.py    a chat checked, and its tools placed, before its template renders it
grammar.py          structured output's grammars, bounded and compiled under a deadline
stop_strings.py     stop-string matching, shared by worker and detokenizer
errors.py           `RequestError`: a refused or failed request, on either side of the bus
job_failures.py     the error reply for a job that cannot be served
tool_format.py      how tool calls look in the model's text (Hermes)
"""
