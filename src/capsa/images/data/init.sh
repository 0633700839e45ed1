#!/bin/sh
# capsa initramfs /init: load the virtio drivers, mount the root disk and hand over to the guest's
# init. Every failure is printed on the console and powers the VM off, so the host sees a clear
# message and an exited QEMU instead of a kernel panic or a hang.
PATH=/bin
export PATH

fail() {
    echo "capsa-initramfs: FATAL: $*" >/dev/console 2>/dev/null || echo "capsa-initramfs: FATAL: $*"
    sleep 1
    poweroff -f
    # Only reached if power-off is unsupported: park rather than let the kernel panic silently.
    while :; do sleep 3600; done
}

mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sysfs /sys || fail "cannot mount /sys"
mount -t devtmpfs devtmpfs /dev || fail "cannot mount /dev"

root=/dev/vda
mode=rw
target=/sbin/capsa-init
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        root=*) root="${arg#root=}" ;;
        ro) mode=ro ;;
        rw) mode=rw ;;
        capsa.init=*) target="${arg#capsa.init=}" ;;
    esac
done

while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/lib/modules/$mod.ko" || fail "cannot load kernel module $mod"
done </lib/modules/order

# virtio-blk normally appears as soon as its module is loaded; allow a slow emulated machine 10 s.
tries=0
while [ ! -b "$root" ]; do
    tries=$((tries + 1))
    [ "$tries" -le 1000 ] || fail "root disk $root did not appear (disk attached? microvm acpi=on?)"
    sleep 0.01
done

mount -t ext4 -o "$mode" "$root" /newroot || fail "cannot mount $root as ext4"
[ -x "/newroot$target" ] || fail "$target is missing from the root filesystem"

mount --move /dev /newroot/dev || fail "cannot move /dev into the root filesystem"
umount /sys
umount /proc
exec switch_root /newroot "$target"
