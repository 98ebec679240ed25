"""`dflashops dashboard`: the fleet on one web page (DESIGN "The fleet on one page").

- ``fleet``: the looks at the fleet that `top` refreshes and the dashboard samples (kept
  sessions, one probe per host per look);
- ``sample``: one look as data (``Sample``: hosts and units, raw values) and the events
  between two looks;
- ``store``: samples in SQLite beside the inventory (``.dflashops/samples.sqlite``), bounded
  by age, with coarser copies for long plots;
- ``sampler``: the loop that looks every interval and keeps what it saw (``sample_fleet``);
- ``plots``: line plots drawn as SVG on the server; ``page``: the page's JSON document;
- ``server``: the HTTP server (the page, its JSON, /metrics), the token, what is logged;
- ``prom``: the fleet's own Prometheus series;
- ``static/``: the page, its style and its script (no CDN: it works offline).
"""
