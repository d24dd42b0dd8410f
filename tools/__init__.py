"""Scripts the team runs by hand (not part of the library or of ``make test``)."""
