"""The notebooks' glue: every chain parameter and the profiles (``profiles``), one setup call per notebook
(``session``) and the drift explorer's widgets (``explorer``)."""
