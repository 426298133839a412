"""Trade-offs between plans: the time-memory frontier, the generic layouts a practitioner
writes (margins), the logical views of the devices, and the device-count sweep."""
