"""OpenAI's Responses API (``/v1/responses``) over the chat path.

request.py  a Responses body checked and turned into the chat job the pipeline runs
output.py   the job's replies as a Response object and its stream events, in OpenAI's order
turn.py     one turn: the job submitted, its replies relayed, the response stored
store.py    stored responses in Redis, owned by their tenant, with an expiry
quota.py    what one owner's stored responses may hold; past it the oldest go
resume.py   a stream whose replica died, resumed by GET ?stream=true&starting_after=
background.py  background responses' tasks, taken over by another replica if theirs dies
items.py    a response's input as OpenAI's items, for GET .../input_items
routes.py   create (whole, streamed, background), retrieve, delete, cancel, input items
"""
