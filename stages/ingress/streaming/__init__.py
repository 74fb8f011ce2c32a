"""One HTTP request's sub-requests on the bus, and streams picked up again.

submission.py  sub-requests from XADD to their last reply
reply_queue.py a submission's queue of replies, and the watchdog's and relay's words in it
resume.py      `Last-Event-ID`: a dropped stream resumed from the replies kept in Redis
"""
