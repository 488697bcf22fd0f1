"""Files and pictures: reading images (``images.py``), rendering maps on them (``render.py``), writing files
whole or not at all (``atomic.py``)."""
