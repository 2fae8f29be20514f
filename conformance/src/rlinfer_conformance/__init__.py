"""rlinfer conformance kit: the contract as a pytest plugin."""
