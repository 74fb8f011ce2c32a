"""The transport: how jobs and replies move over Redis streams. No torch.

actor.py          `Actor`: a CPU stage replica's loop on its consumer group, each turn's
                  effects and acknowledgements committed in one MULTI (a replayable stage's
                  effects pipelined, its acknowledgements sent with its next read)
extra_inputs.py   the streams a stage reads besides its own (the detokenizers: every worker's
                  progress log, which carries its token batches)
stale_claims.py   taking over what a dead consumer left pending, and the poison among it
effects.py        what a stage's turn writes (`Outbound`, `SetKey`, `ExpireKey`, ...)
fenced_stream.py  a worker's own stream, written only under its fence (its progress log, which
                  carries its token batches and which the reaper closes)
fence_off.py      the reaper's claim that closes a worker's log; the log read in order
liveness.py       which workers are alive: the shared reader of their heartbeats, sync and async
scripted_multi.py a worker's fenced commit as one Lua script call (not WATCH, GET, MULTI, EXEC),
                  its first write the fence
reconnect.py      every consumer loop's backoff on outages and its group made again
stream_trim.py    trimming a stream only below what every group has read and acknowledged
aborts.py         aborts: flags a worker checks as it admits a job, the aborts stream the
                  worker holding it reads
client.py         direct Redis jobs: `Client` and `AsyncClient`
replies.py        reading a reply stream, in order, for many requests at once
reply_router.py   what a reply stream's readers share: whose each entry is, where to read next
reply_order.py    one request's replies put back in output order
reply_tags.py     the short tags a reply stream's reader gives its jobs, mapped back to rids
access.py         the credentials a process is given, checked at start-up
async_pool.py     the ingress's asyncio connection pool, and sends on a connection kept apart
weights_admin.py  the fleet's weights record set, and each worker's version read
"""
