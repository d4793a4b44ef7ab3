"""The dtype audit of a lowered program and the device facts it is compared with."""
