"""Name resolution and the special-purpose address registry: the ground floor the gateway's
TCP path, its DNS firewall and the broker's upstream dialling share."""
