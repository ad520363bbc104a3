package integration

import (
	"syscall"
	"testing"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

// TestStatx: STATX (sent by Linux 6.12 guests, not by 6.1) answers a
// fuse_statx_out whose fields match the host file, by node and by handle.
func TestStatx(t *testing.T) {
	d := startDaemon(t)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	node, fh := c.create(vmm.RootID, "sx", syscall.O_RDWR)
	c.write(node, fh, 0, pattern(5, 12345))
	var st syscall.Stat_t
	if err := syscall.Stat(d.dir+"/sx", &st); err != nil {
		t.Fatal(err)
	}
	const getattrFh = 1 // FUSE_GETATTR_FH
	for _, tc := range []struct {
		name  string
		flags uint32
		fh    uint64
	}{{"by node", 0, 0}, {"by handle", getattrFh, fh}} {
		t.Run(tc.name, func(t *testing.T) {
			// fuse_statx_in: getattr_flags, reserved, fh, sx_flags, sx_mask.
			in := le32(le32(le64(le32(le32(nil, tc.flags), 0), tc.fh), 0), 0x7ff)
			body, err := c.Call(vmm.OpStatx, node, in, nil, 32+256)
			if err != nil {
				t.Fatalf("STATX: %v", err)
			}
			if len(body) != 32+256 {
				t.Fatalf("fuse_statx_out of %d bytes", len(body))
			}
			sx := body[32:] // struct fuse_statx
			if mode := le.Uint16(sx[28:]); uint32(mode) != st.Mode {
				t.Errorf("mode %o, host %o", mode, st.Mode)
			}
			if nlink := le.Uint32(sx[16:]); nlink != uint32(st.Nlink) {
				t.Errorf("nlink %d, host %d", nlink, st.Nlink)
			}
			if ino := le.Uint64(sx[32:]); ino != st.Ino {
				t.Errorf("ino %d, host %d", ino, st.Ino)
			}
			if size := le.Uint64(sx[40:]); size != 12345 {
				t.Errorf("size %d, want 12345", size)
			}
		})
	}
	// A stale node gets an error, not a crash.
	if _, err := c.Call(vmm.OpStatx, 0xdead0000beef, le32(le32(le64(le32(le32(nil, 0), 0), 0), 0), 0x7ff), nil, 32+256); err == nil {
		t.Error("STATX of an invented node succeeded")
	}
}
