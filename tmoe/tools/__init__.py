"""Command-line tools beside the library (benchmark, peers, tuner, demo, host overhead); the library never imports them."""
