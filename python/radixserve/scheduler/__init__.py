"""The scheduler process's core: request state, batch construction, policies and event loops."""

from radixserve.scheduler.req import Req
from radixserve.scheduler.schedule_batch import ScheduleBatch
from radixserve.scheduler.scheduler import Scheduler

__all__ = ["Req", "ScheduleBatch", "Scheduler"]
