"""Locust entry point of the chart's load test: loadtest/sla.py, plus the router's API key.

With SLA_API_KEY set, every HTTP request of the run (Locust's client and sla.py's own
/server_info and /v1/models calls, both `requests` sessions) carries
"Authorization: Bearer <key>". Without it this is sla.py unchanged. sla.py and its
loadmetrics.py sit beside this file, as in the repository's loadtest/.
"""

import os

import requests

_KEY = os.environ.get("SLA_API_KEY", "")
if _KEY:
    _send = requests.Session.request

    def _request_with_key(self, method, url, *args, **kwargs):
        headers = dict(kwargs.pop("headers", None) or {})
        headers.setdefault("Authorization", f"Bearer {_KEY}")
        return _send(self, method, url, *args, headers=headers, **kwargs)

    requests.Session.request = _request_with_key

# ChatUser, ConcurrencySweep and sla.py's event hooks, after the patch above.
from sla import *
