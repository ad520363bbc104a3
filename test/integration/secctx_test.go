package integration

// FUSE_SECURITY_CTX and the Rust virtiofsd 1.14's negotiation modes, as a
// guest drives them: --security-label and --posix-acl as never, auto and
// always against an INIT that offers them (Linux 6.1 does) or not, and
// creation requests carrying the caller's security context as Linux
// lays it out (fs/fuse/dir.c, get_security_context), labelled on the
// host object. This host has no LSM: the tests use a security.* name,
// which ext4 and tmpfs store for a process with CAP_SYS_ADMIN (without an
// LSM that owns the name, the kernel asks that capability of any
// security.* write): the sandbox drops it unless --modcaps gives it back.

import (
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/govirtiofsd/govirtiofsd/test/vmm"
)

const (
	testLabelName = "security.govirtiofsd-test"
	testLabel     = "system_u:object_r:container_file_t:s0:c7,c9\x00" // SELinux sends the NUL
)

// secCtxArea is a request's extension area with one security context
// (nr_secctx 1), or the bare header a guest without an LSM sends (name "").
func secCtxArea(name, value string) []byte {
	if name == "" {
		return le32(le32(nil, 8), 0)
	}
	e := le32(le32(nil, uint32(len(value))), 0) // fuse_secctx: size, padding
	e = append(append(append(e, name...), 0), value...)
	for len(e)%8 != 0 {
		e = append(e, 0)
	}
	return append(le32(le32(nil, uint32(8+len(e))), 1), e...) // fuse_secctx_header: size, nr_secctx
}

// createReq sends op with args and the extension area ext and returns
// the reply's errno and body.
func (c *fsc) createReq(dev *vmm.Device, op uint32, parent uint64, args, ext []byte, outArgs int) (syscall.Errno, []byte) {
	c.t.Helper()
	h := c.Header(op, parent)
	h.TotalExtlen = uint16(len(ext) / 8)
	in := vmm.BuildRequest(h, 0, append(append([]byte(nil), args...), ext...))
	reply, err := dev.Do(c.Queue, in, nil, vmm.FuseOutHeaderSize+outArgs)
	if err != nil {
		c.t.Fatal(err)
	}
	oh, body, err := vmm.ParseReply(reply)
	if err != nil {
		c.t.Fatal(err)
	}
	return syscall.Errno(-oh.Error), body
}

func hostLabel(p string) (string, error) {
	b := make([]byte, 256)
	n, err := unix.Lgetxattr(p, testLabelName, b)
	if err != nil {
		return "", err
	}
	return string(b[:n]), nil
}

// labelArgs gives the sandboxed daemon CAP_SYS_ADMIN back (see above).
func labelArgs(mode string) []string {
	a := []string{"--security-label" + mode}
	if sandboxMode != "" {
		a = append(a, "--modcaps=+sys_admin")
	}
	return a
}

// TestSecurityLabelCreations: with --security-label (the bare flag:
// always) a Linux 6.1 INIT negotiates SECURITY_CTX, and MKDIR, MKNOD,
// SYMLINK, CREATE and TMPFILE label what they make with the context the
// request carries; the bare header (no LSM in the guest) labels nothing;
// a malformed context is EINVAL and creates nothing.
func TestSecurityLabelCreations(t *testing.T) {
	d := startDaemon(t, labelArgs("")...)
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	if o := c.mount(); o.Flags&vmm.InitSecurityCtx == 0 {
		t.Fatalf("SECURITY_CTX not negotiated: flags %#x", o.Flags)
	}
	ext := secCtxArea(testLabelName, testLabel)
	const entry = vmm.FuseEntryOutSize
	for _, r := range []struct {
		name string
		op   uint32
		args []byte
		out  int
	}{
		{"d", vmm.OpMkdir, append(le32(le32(nil, 0o755), 0o022), "d\x00"...), entry},
		{"fifo", vmm.OpMknod, append(le32(le32(le32(le32(nil, syscall.S_IFIFO|0o644), 0), 0o022), 0), "fifo\x00"...), entry},
		{"link", vmm.OpSymlink, []byte("link\x00target\x00"), entry},
		{"file", vmm.OpCreate, createIn(syscall.O_RDWR, 0o100644, "file"), entry + 16},
	} {
		if errno, _ := c.createReq(dev, r.op, vmm.RootID, r.args, ext, r.out); errno != 0 {
			t.Fatalf("%s: %v", r.name, errno)
		}
		if got, err := hostLabel(filepath.Join(d.dir, r.name)); err != nil || got != testLabel {
			t.Errorf("%s: host label %q, %v", r.name, got, err)
		}
	}
	// TMPFILE (opcode 51): an unnamed file, labelled through its fd.
	errno, body := c.createReq(dev, 51, c.lookup(vmm.RootID, "d").NodeID, createIn(syscall.O_RDWR, 0o100600, ""), ext, entry+16)
	if errno != 0 {
		t.Fatalf("TMPFILE: %v", errno)
	}
	fh := le.Uint64(body[entry:])
	e, _ := vmm.ParseEntryOut(body[:entry])
	if xb, err := c.Call(vmm.OpGetxattr, e.NodeID, append(le32(le32(nil, 256), 0), testLabelName+"\x00"...), nil, 256); err != nil || string(xb) != testLabel {
		t.Errorf("tmpfile label %q, %v", xb, err)
	}
	c.Call(vmm.OpRelease, e.NodeID, le64(le64(nil, fh), 0), nil, 0)

	// No LSM in the guest: the bare header, nothing labelled.
	if errno, _ := c.createReq(dev, vmm.OpMkdir, vmm.RootID, append(le32(le32(nil, 0o755), 0o022), "plain\x00"...), secCtxArea("", ""), entry); errno != 0 {
		t.Fatalf("MKDIR with the bare header: %v", errno)
	}
	if got, err := hostLabel(filepath.Join(d.dir, "plain")); !errors.Is(err, unix.ENODATA) {
		t.Errorf("plain: label %q, %v", got, err)
	}
	// Malformed: a label longer than the extension; a name outside the
	// security namespace.
	bad := secCtxArea(testLabelName, testLabel)
	bad[8] = 200
	for _, x := range [][]byte{bad, secCtxArea("trusted.x", "y")} {
		if errno, _ := c.createReq(dev, vmm.OpMkdir, vmm.RootID, append(le32(le32(nil, 0o755), 0o022), "bad\x00"...), x, entry); errno != syscall.EINVAL {
			t.Errorf("malformed context: %v, want EINVAL", errno)
		}
		if _, err := os.Lstat(filepath.Join(d.dir, "bad")); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("bad created: %v", err)
		}
	}
	noViolations(t, dev)
}

// TestSecurityLabelNoCapability: in the sandbox without CAP_SYS_ADMIN
// (the default, as the Rust daemon's) a host without an LSM refuses the
// security.* write: the creation fails with EPERM and leaves nothing, as
// in the Rust daemon 1.14.
func TestSecurityLabelNoCapability(t *testing.T) {
	if sandboxMode == "" {
		t.Skip("the race build runs without the sandbox: all of root's capabilities")
	}
	d := startDaemon(t, "--security-label")
	dev := d.connect(opts())
	c := newFS(t, dev, 1)
	c.mount()
	if errno, _ := c.createReq(dev, vmm.OpMkdir, vmm.RootID, append(le32(le32(nil, 0o755), 0o022), "d\x00"...),
		secCtxArea(testLabelName, testLabel), vmm.FuseEntryOutSize); errno != syscall.EPERM {
		t.Fatalf("MKDIR: %v, want EPERM", errno)
	}
	if _, err := os.Lstat(filepath.Join(d.dir, "d")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("d left behind: %v", err)
	}
	noViolations(t, dev)
}

// TestNegotiationModes: the Rust daemon 1.14's launch lines against a
// guest that offers SECURITY_CTX and POSIX ACLs (Linux 6.1) and one that
// offers neither: always refuses the second's INIT (EPROTO), auto leaves
// the feature off, never never offers it.
func TestNegotiationModes(t *testing.T) {
	const full = vmm.LinuxInitFlags
	const bare = vmm.LinuxInitFlags &^ (vmm.InitSecurityCtx | vmm.InitPosixACL)
	for _, tc := range []struct {
		args     []string
		offered  uint64
		refused  bool
		wantCaps uint64 // of SECURITY_CTX | POSIX_ACL
	}{
		{[]string{"--security-label=auto"}, full, false, vmm.InitSecurityCtx},
		{[]string{"--security-label=auto"}, bare, false, 0},
		{[]string{"--security-label=always"}, bare, true, 0},
		{[]string{"--security-label"}, bare, true, 0},
		{[]string{"--security-label=never"}, full, false, 0},
		{[]string{"--posix-acl=auto"}, full, false, vmm.InitPosixACL},
		{[]string{"--posix-acl=auto"}, bare, false, 0},
		{[]string{"--posix-acl=always"}, full, false, vmm.InitPosixACL},
		{[]string{"--posix-acl=always"}, bare, true, 0},
		{[]string{"--posix-acl"}, bare, true, 0},
		{[]string{"-o", "posix_acl,security_label"}, full, false, vmm.InitPosixACL | vmm.InitSecurityCtx},
		{nil, full, false, 0},
	} {
		t.Run(launchName(tc.args, tc.offered == full), func(t *testing.T) {
			d := startDaemon(t, tc.args...)
			dev := d.connect(opts())
			c := newFS(t, dev, 1)
			o, err := c.Init(vmm.KernelMinor, tc.offered)
			if tc.refused {
				if !errors.Is(err, syscall.EPROTO) {
					t.Fatalf("INIT: %v, want EPROTO", err)
				}
				if d.logCount("FUSE INIT refused") != 1 {
					t.Errorf("no log line for the refusal\n%s", d.Tail(10))
				}
				// The guest (a driver reset) may try again.
				if _, err := c.Init(vmm.KernelMinor, full); err != nil {
					t.Fatalf("INIT offering everything after a refusal: %v", err)
				}
				noViolations(t, dev)
				return
			}
			if err != nil {
				t.Fatalf("INIT: %v", err)
			}
			if got := o.Flags & (vmm.InitSecurityCtx | vmm.InitPosixACL); got != tc.wantCaps {
				t.Fatalf("negotiated %#x, want %#x", got, tc.wantCaps)
			}
			if tc.wantCaps&vmm.InitSecurityCtx == 0 {
				// Not negotiated: a context is an unknown extension.
				if errno, _ := c.createReq(dev, vmm.OpMkdir, vmm.RootID, append(le32(le32(nil, 0o755), 0o022), "d\x00"...),
					secCtxArea("", ""), vmm.FuseEntryOutSize); errno != syscall.EINVAL {
					t.Errorf("context without SECURITY_CTX: %v, want EINVAL", errno)
				}
			}
			c.roundTrip(d, "f", pattern(1, 4096))
			noViolations(t, dev)
		})
	}
}

func launchName(args []string, full bool) string {
	n := "default"
	if len(args) > 0 {
		n = args[len(args)-1]
	}
	if full {
		return n + "/offered"
	}
	return n + "/not-offered"
}
