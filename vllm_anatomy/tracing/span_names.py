"""The names of the spans that other code looks for by name: the request's span (vLLM's
`llm_request`, under which a request's life is traced) and, for n > 1, the span of the parent
request over its children. The request tracer starts them; the trace checker and the Perfetto
exporter find requests by them."""
from __future__ import annotations

REQUEST_SPAN = "llm_request"
PARENT_REQUEST_SPAN = "ParentRequest"
REQUEST_SPANS = (REQUEST_SPAN, PARENT_REQUEST_SPAN)
