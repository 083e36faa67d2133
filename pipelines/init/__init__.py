"""`habitus init`: a connection's tables profiled and a project config suggested."""
