"""What an operator watches a job by: Prometheus metrics of a serve job (metrics.py), a
Chrome trace-event timeline of a job's stages per rank (timeline.py), and log lines as JSON
objects (logs.py). Nothing here is imported by `ckptctl --help`; prometheus_client only when
`serve --metrics-port` asks for it."""
