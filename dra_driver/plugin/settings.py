"""The health stream's timing, shared with the agent's Config (node/config.py checks
``--health-report-interval`` against it).

Flow position: node/config.py and health_stream.py read these; node/ gives the kubelet plugin
its sockets' directories and the stream's interval (kubelet.KubeletPlugin).
"""

from __future__ import annotations

# The health stream (health_stream.py). The kubelet shows a device Unknown once this long passed
# without a report of it; 30 s is its own default (pkg/kubelet/cm/dra/healthinfo.go
# DefaultHealthTimeout), announced in every report's health_check_timeout_seconds.
HEALTH_TIMEOUT_S = 30
# How often the full list is re-sent (--health-report-interval): at most half the timeout, so
# one lost or late report never turns a healthy device Unknown.
DEFAULT_HEALTH_REPORT_INTERVAL_S = 10.0
MIN_HEALTH_REPORT_INTERVAL_S = 0.1
MAX_HEALTH_REPORT_INTERVAL_S = HEALTH_TIMEOUT_S / 2
