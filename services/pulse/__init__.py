"""`zeroqueue pulse`: the open-loop load test that compares deadline admission with a FIFO queue."""
