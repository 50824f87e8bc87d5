"""The serving load generator behind `orchard bench` (and bench/'s serving comparisons): client (one streamed
request, timed per network read), workloads (what is sent and when), stats (summaries), load (a suite against one
server, and its own command line), tables and plots (the results side by side), images (synthetic pictures)."""
