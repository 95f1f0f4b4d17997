"""The processes: the supervisor behind ``runworkers``, its workers and their runners, the dispatcher."""
