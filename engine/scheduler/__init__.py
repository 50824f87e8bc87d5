from engine.scheduler.output import PrefillChunk, SchedulerOutput
from engine.scheduler.scheduler import Scheduler

__all__ = ["PrefillChunk", "Scheduler", "SchedulerOutput"]
