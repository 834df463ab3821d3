"""What a page shows, read lazily from the archive: token views, attention grids and patterns,
lrp components, and the opened runs kept between answers; and the token view's own code (static/,
page_code.py). serve and the report both call it."""
