"""The regression gates of ``moebench check``: store against store, ratios inside one store, and
a suite on another commit against the working tree. Separate from the page renderers beside it;
both read stores through :mod:`moebench.report.build`."""
