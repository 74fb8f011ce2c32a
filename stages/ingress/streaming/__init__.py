"""One HTTP request's sub-requests on the bus, and streams picked up again.

submission.py  sub-requests from XADD to their last reply
resume.py      `Last-Event-ID`: a dropped stream resumed from the replies kept in Redis
"""
