# Nothing beyond the mount done by /init: /init then unmounts and runs poweroff -f.
step mounted grep ' /mnt ' /proc/mounts
