"""What the proxy tells its operators: its own Prometheus metrics and the access log.

Rules: only the core's types are imported; nothing here decides or performs a request. Every metric
is named ``kvproxy_*`` and has a bounded label set; the access log never carries a key.
"""
