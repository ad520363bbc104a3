package integration

import (
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestXattrmapImpliesXattr: --xattrmap alone turns extended attributes on,
// as in the Rust virtiofsd (1.14 answers this SETXATTR through this front
// end; ours answered ENOSYS), and the map applies: the guest's user.a is
// user.virtiofs.user.a on the host.
func TestXattrmapImpliesXattr(t *testing.T) {
	d := startDaemon(t, "--xattrmap=:map:user.:user.virtiofs.:")
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	o := c.mount()
	n, fh := c.create(vmm.RootID, "f", unix.O_RDWR)
	args := le32(le32(nil, 1), 0) // fuse_setxattr_in: size, flags
	if o.Flags&vmm.InitSetxattrExt != 0 {
		args = le32(le32(args, 0), 0) // setxattr_flags, padding
	}
	if _, err := c.Call(vmm.OpSetxattr, n, append(args, "user.a\x00v"...), nil, 0); err != nil {
		t.Fatalf("SETXATTR: %v", err)
	}
	b := make([]byte, 8)
	if m, err := unix.Lgetxattr(filepath.Join(d.dir, "f"), "user.virtiofs.user.a", b); err != nil || string(b[:m]) != "v" {
		t.Fatalf("host xattr %q, %v", b[:max(m, 0)], err)
	}
	c.Call(vmm.OpRelease, n, le64(le64(nil, fh), 0), nil, 0)
	noViolations(t, dev)
}
