package passthrough

import (
	"bytes"
	"errors"
	"os"
	"slices"
	"syscall"
	"testing"
	"unsafe"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// hostXattr reads name of the host object at p (not following a symlink).
func hostXattr(t *testing.T, p, name string) (string, error) {
	t.Helper()
	b := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, b)
	if err != nil {
		return "", err
	}
	return string(b[:n]), nil
}

// needSecurityXattrs skips unless the test share's file system takes
// security.* names from this process (root, CAP_SYS_ADMIN: ext4 and tmpfs
// do without an LSM).
func needSecurityXattrs(t *testing.T, dir string) {
	t.Helper()
	p := dir + "/.probe"
	os.WriteFile(p, nil, 0o644)
	defer os.Remove(p)
	if err := unix.Lsetxattr(p, "security.govirtiofsd-probe", []byte("x"), 0); err != nil {
		t.Skipf("security.* xattrs not settable here: %v", err)
	}
}

// TestSecCtxCreate: every creation labels the new host object with the
// guest's context, as the caller's object (owner as with no context); a
// symlink and a device node are labelled themselves.
func TestSecCtxCreate(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, SecurityLabel: true})
	needSecurityXattrs(t, tf.dir)
	os.Chmod(tf.dir, 0o777) // for the caller 1000
	sec := &SecCtx{Name: []byte("security.govirtiofsd"), Value: []byte("u:r:t:s0\x00")}
	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdrAs(rootID, 1000, 1001), Mode: 0o755}, noGroup, sec, []byte("d"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdr(rootID), Mode: syscall.S_IFIFO | 0o644}, noGroup, sec, []byte("p"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Mknod(&gofuse.MknodIn{InHeader: *hdr(rootID), Mode: syscall.S_IFCHR | 0o600, Rdev: uint32(unix.Mkdev(1, 3))}, noGroup, sec, []byte("null"), &e); errno != 0 {
		t.Fatal(errno)
	}
	if errno := tf.Symlink(hdr(rootID), noGroup, sec, []byte("d"), []byte("l"), &e); errno != 0 {
		t.Fatal(errno)
	}
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdrAs(rootID, 1000, 1001), Flags: syscall.O_RDWR, Mode: 0o640}, noGroup, sec, []byte("f"), &co); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(co.NodeId, co.Fh)
	for _, n := range []string{"d", "p", "null", "l", "f"} {
		if got, err := hostXattr(t, tf.path(n), "security.govirtiofsd"); err != nil || got != "u:r:t:s0\x00" {
			t.Errorf("%s: label %q, %v", n, got, err)
		}
	}
	// The symlink's target was not labelled through it: only d is, by
	// its own mkdir. The objects are the caller's.
	var st unix.Stat_t
	if unix.Lstat(tf.path("f"), &st) != nil || st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o777 != 0o640 {
		t.Fatalf("f: %+v", st)
	}
	// TMPFILE: labelled before it has a name.
	if errno := tf.Tmpfile(&gofuse.CreateIn{InHeader: *hdr(e.NodeId), Flags: syscall.O_RDWR, Mode: 0o600}, noGroup, sec, &co); errno != syscall.ENOTDIR {
		t.Fatalf("TMPFILE in a symlink: %v", errno)
	}
	tf.Forget(e.NodeId, 1)
	d := tf.lookup(rootID, "d")
	if errno := tf.Tmpfile(&gofuse.CreateIn{InHeader: *hdr(d.NodeId), Flags: syscall.O_RDWR, Mode: 0o600}, noGroup, sec, &co); errno != 0 {
		t.Fatal(errno)
	}
	h, errno := tf.getHandle(co.Fh, handleFile)
	if errno != 0 {
		t.Fatal(errno)
	}
	b := make([]byte, 64)
	n, err := unix.Fgetxattr(h.fd, "security.govirtiofsd", b)
	h.put()
	if err != nil || string(b[:n]) != "u:r:t:s0\x00" {
		t.Fatalf("tmpfile label %q, %v", b[:n], err)
	}
	tf.release(co.NodeId, co.Fh)
}

// TestSecCtxXattrmap: the context's name goes through --xattrmap as a
// SETXATTR's would (the setup the Rust daemon documents: the guest's
// security.selinux kept apart from the host's), and a name the map
// refuses fails the creation, which leaves nothing behind.
func TestSecCtxXattrmap(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, SecurityLabel: true,
		XattrMap: ":bad:all:security.forbidden:: :map:security.selinux:user.virtiofs.:"})
	sel := &SecCtx{Name: []byte("security.selinux"), Value: []byte("guest_u:object_r:guest_t:s0")}
	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, sel, []byte("d"), &e); errno != 0 {
		t.Fatal(errno)
	}
	var co gofuse.CreateOut
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: syscall.O_RDWR, Mode: 0o644}, noGroup, sel, []byte("f"), &co); errno != 0 {
		t.Fatal(errno)
	}
	tf.release(co.NodeId, co.Fh)
	for _, n := range []string{"d", "f"} {
		if got, err := hostXattr(t, tf.path(n), "user.virtiofs.security.selinux"); err != nil || got != "guest_u:object_r:guest_t:s0" {
			t.Errorf("%s: mapped label %q, %v", n, got, err)
		}
		if _, err := hostXattr(t, tf.path(n), "security.selinux"); err == nil {
			t.Errorf("%s: host security.selinux set", n)
		}
	}
	bad := &SecCtx{Name: []byte("security.forbidden"), Value: []byte("x")}
	checkRefused := func(what string, errno syscall.Errno, name string) {
		t.Helper()
		if errno == 0 {
			t.Fatalf("%s with a refused name succeeded", what)
		}
		if _, err := os.Lstat(tf.path(name)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s: %s left behind (%v)", what, name, err)
		}
	}
	checkRefused("MKDIR", tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, bad, []byte("bd"), &e), "bd")
	checkRefused("SYMLINK", tf.Symlink(hdr(rootID), noGroup, bad, []byte("t"), []byte("bl"), &e), "bl")
	checkRefused("MKNOD", tf.Mknod(&gofuse.MknodIn{InHeader: *hdr(rootID), Mode: syscall.S_IFREG | 0o644}, noGroup, bad, []byte("bn"), &e), "bn")
	checkRefused("CREATE", tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: syscall.O_RDWR, Mode: 0o644}, noGroup, bad, []byte("bf"), &co), "bf")
	if got := tf.Stats(); got.Handles != 0 {
		t.Fatalf("handles left: %+v", got)
	}
}

// TestSecCtxOff: without --security-label a context (which the server
// only passes when SECURITY_CTX was negotiated) is refused, nothing
// created; an existing file a CREATE opens keeps its label.
func TestSecCtxOff(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true})
	sec := &SecCtx{Name: []byte("security.govirtiofsd"), Value: []byte("x")}
	var e gofuse.EntryOut
	if errno := tf.Mkdir(&gofuse.MkdirIn{InHeader: *hdr(rootID), Mode: 0o755}, noGroup, sec, []byte("d"), &e); errno != syscall.EOPNOTSUPP {
		t.Fatalf("MKDIR: %v", errno)
	}
	if _, err := os.Lstat(tf.path("d")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("d left behind: %v", err)
	}
	on := newTestFS(t, Options{Xattr: true, SecurityLabel: true})
	needSecurityXattrs(t, on.dir)
	os.WriteFile(on.path("old"), []byte("o"), 0o644)
	unix.Setxattr(on.path("old"), "security.govirtiofsd", []byte("old"), 0)
	var co gofuse.CreateOut
	if errno := on.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: syscall.O_RDWR, Mode: 0o644}, noGroup, sec, []byte("old"), &co); errno != 0 {
		t.Fatal(errno)
	}
	on.release(co.NodeId, co.Fh)
	if got, _ := hostXattr(t, on.path("old"), "security.govirtiofsd"); got != "old" {
		t.Fatalf("existing file relabelled: %q", got)
	}
}

// TestNegotiateModes: --posix-acl and --security-label as never, auto
// and always against guests that do and do not offer them.
func TestNegotiateModes(t *testing.T) {
	const all = aclCaps | gofuse.CAP_SECURITY_CTX
	for _, tc := range []struct {
		name    string
		opts    Options
		offered uint64
		want    uint64 // of all
		refused bool
	}{
		{"never", Options{Xattr: true}, all, 0, false},
		{"auto, offered", Options{Xattr: true, PosixACL: true, SecurityLabel: true}, all, all, false},
		{"auto, not offered", Options{Xattr: true, PosixACL: true, SecurityLabel: true}, 0, 0, false},
		{"auto ACLs, DONT_MASK missing", Options{Xattr: true, PosixACL: true}, all &^ gofuse.CAP_DONT_MASK, 0, false},
		{"always, offered", Options{Xattr: true, PosixACL: true, RequirePosixACL: true, SecurityLabel: true, RequireSecurityLabel: true}, all, all, false},
		{"always ACLs, not offered", Options{Xattr: true, PosixACL: true, RequirePosixACL: true}, gofuse.CAP_SECURITY_CTX, 0, true},
		{"always ACLs, SETXATTR_EXT missing", Options{Xattr: true, PosixACL: true, RequirePosixACL: true}, all &^ gofuse.CAP_SETXATTR_EXT, 0, true},
		{"always labels, not offered", Options{Xattr: true, SecurityLabel: true, RequireSecurityLabel: true}, aclCaps, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newTestFS(t, tc.opts)
			caps := tc.offered & f.Capabilities() // what the server would answer
			got, err := f.Negotiate(tc.offered, caps)
			if (err != nil) != tc.refused {
				t.Fatalf("err %v, refused %v", err, tc.refused)
			}
			if err == nil && got&all != tc.want {
				t.Fatalf("answer %#x, want %#x of %#x", got&all, tc.want, uint64(all))
			}
		})
	}
}

// TestACLsNotNegotiated: with --posix-acl=auto and a guest that did not
// take ACLs, their xattrs are refused and hidden, as with ACLs off.
func TestACLsNotNegotiated(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, PosixACL: true})
	tf.Init(tf.Capabilities() &^ aclCaps)
	e := tf.create(rootID, "f", syscall.O_RDWR, 0o644)
	tf.release(e.NodeId, e.Fh)
	in := &gofuse.SetXAttrIn{InHeader: *hdr(e.NodeId)}
	acl := []byte{2, 0, 0, 0, 1, 0, 6, 0, 0xff, 0xff, 0xff, 0xff, 4, 0, 4, 0, 0xff, 0xff, 0xff, 0xff, 0x20, 0, 4, 0, 0xff, 0xff, 0xff, 0xff}
	if errno := tf.SetXAttr(in, []byte("system.posix_acl_access"), acl); errno != syscall.EOPNOTSUPP {
		t.Fatalf("ACL set without the session's POSIX_ACL: %v", errno)
	}
	tf.Init(tf.Capabilities())
	e = tf.create(rootID, "g", syscall.O_RDWR, 0o644)
	tf.release(e.NodeId, e.Fh)
	in = &gofuse.SetXAttrIn{InHeader: *hdr(e.NodeId)}
	if errno := tf.SetXAttr(in, []byte("system.posix_acl_access"), acl); errno != 0 {
		t.Fatalf("ACL set with POSIX_ACL negotiated: %v", errno)
	}
}

// TestSecCtxCreateAtomic: a labelled CREATE never shows its name without
// the label. inotify on the directory sees one IN_CREATE per created file,
// and at that moment the label is already there; a labelling that fails
// shows no name at all (no IN_CREATE, no IN_DELETE). The handle has the
// guest's access mode although O_TMPFILE needed write access, and an
// existing name is EEXIST with O_EXCL.
func TestSecCtxCreateAtomic(t *testing.T) {
	tf := newTestFS(t, Options{Xattr: true, SecurityLabel: true, XattrMap: ":bad:all:security.forbidden:: :ok:all:::"})
	needSecurityXattrs(t, tf.dir)
	in, err := unix.InotifyInit1(unix.IN_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(in)
	if _, err := unix.InotifyAddWatch(in, tf.dir, unix.IN_CREATE|unix.IN_DELETE|unix.IN_MOVED_TO); err != nil {
		t.Fatal(err)
	}
	const label = "u:r:t:s0\x00"
	sec := &SecCtx{Name: []byte("security.govirtiofsd"), Value: []byte(label)}
	var co gofuse.CreateOut
	for _, tc := range []struct {
		name  string
		flags uint32
		acc   int
	}{
		{"r", syscall.O_RDONLY, unix.O_RDONLY},
		{"w", syscall.O_WRONLY, unix.O_WRONLY},
		{"rw", syscall.O_RDWR | syscall.O_EXCL, unix.O_RDWR},
	} {
		if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: tc.flags, Mode: 0o640}, noGroup, sec, []byte(tc.name), &co); errno != 0 {
			t.Fatalf("%s: %v", tc.name, errno)
		}
		// The event is read after the CREATE returned; the label must
		// have been on the name since it appeared: check it now, and
		// that the name appeared once (one IN_CREATE, no rename).
		h, errno := tf.getHandle(co.Fh, handleFile)
		if errno != 0 {
			t.Fatal(errno)
		}
		fl, err := unix.FcntlInt(uintptr(h.fd), unix.F_GETFL, 0)
		h.put()
		if err != nil || fl&unix.O_ACCMODE != tc.acc {
			t.Errorf("%s: handle flags %#o, %v", tc.name, fl, err)
		}
		tf.release(co.NodeId, co.Fh)
		if got, err := hostXattr(t, tf.path(tc.name), "security.govirtiofsd"); err != nil || got != label {
			t.Errorf("%s: label %q, %v", tc.name, got, err)
		}
	}
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: syscall.O_RDWR | syscall.O_EXCL, Mode: 0o640}, noGroup, sec, []byte("rw"), &co); errno != syscall.EEXIST {
		t.Fatalf("O_EXCL over an existing name: %v", errno)
	}
	bad := &SecCtx{Name: []byte("security.forbidden"), Value: []byte("x")}
	if errno := tf.Create(&gofuse.CreateIn{InHeader: *hdr(rootID), Flags: syscall.O_RDWR, Mode: 0o640}, noGroup, bad, []byte("bad"), &co); errno == 0 {
		t.Fatal("a refused label created a file")
	}
	var got []string
	buf := make([]byte, 4096)
	unix.SetNonblock(in, true)
	for {
		n, err := unix.Read(in, buf)
		if err != nil || n <= 0 {
			break
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := string(bytes.TrimRight(buf[off+unix.SizeofInotifyEvent:off+unix.SizeofInotifyEvent+int(ev.Len)], "\x00"))
			kind := "create"
			if ev.Mask&unix.IN_DELETE != 0 {
				kind = "delete"
			} else if ev.Mask&unix.IN_MOVED_TO != 0 {
				kind = "moved"
			}
			got = append(got, kind+" "+name)
			off += unix.SizeofInotifyEvent + int(ev.Len)
		}
	}
	if want := []string{"create r", "create w", "create rw"}; !slices.Equal(got, want) {
		t.Fatalf("inotify saw %q, want %q", got, want)
	}
}
