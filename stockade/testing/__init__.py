"""Rigs for tests, benchmarks and the demo: the fake internet (`testnet`) and a throw-away
OpenBao (`devvault`). Product code may start them; they import only the ground floor."""
