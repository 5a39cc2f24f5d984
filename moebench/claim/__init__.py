"""Published claims as data (claim files) and their judgement on results stores (``moebench claim``)."""
