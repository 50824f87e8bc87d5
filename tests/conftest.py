"""Settings for the whole suite."""

from hypothesis import settings

# No per-example deadline: a loaded 2-core machine can slow any example past Hypothesis's 200 ms default,
# which fails a test that found no bug. Example counts still bound each test's work.
settings.register_profile("orchard", deadline=None)
settings.load_profile("orchard")
