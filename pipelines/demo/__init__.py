"""The generated retail warehouse of `habitus demo` and `habitus demo-data`."""
