package passthrough

import (
	"syscall"

	"golang.org/x/sys/unix"
)

// SecCtx is the security context a creation request carries
// (FUSE_SECURITY_CTX, decoded by internal/fuse): the LSM's xattr name,
// in the security namespace, and the label. The same unnamed struct type
// as internal/fuse.SecCtx, which this package does not import.
type SecCtx = struct {
	Name, Value []byte
}

// How a new object gets the guest's label, under the name --xattrmap maps
// the guest's to, before the reply; if labelling fails the creation fails
// with that error and leaves nothing behind.
//   - A regular file (CREATE) is an O_TMPFILE made as the caller, labelled
//     while it has no name, then linked under its name (createLabelled): no
//     one ever sees the name unlabelled. Where the file system has no
//     O_TMPFILE, it is made as a directory is.
//   - A TMPFILE is labelled before the guest can link it.
//   - A directory, symlink or special file is created as the caller, then
//     labelled by the daemon, and removed if that fails, as the Rust
//     virtiofsd 1.14 does for every creation (it has no
//     /proc/thread-self/attr/fscreate path, which needs SELinux on the
//     host): another host process could see it unlabelled for that moment;
//     the guest never does.
// Writing security.* needs CAP_SYS_ADMIN unless an LSM that owns the name
// (SELinux for security.selinux) allows it: without, labelling fails with
// EPERM.

// secCtxName maps the context's name for the host into cn: as SETXATTR
// would (xattrName: --xattrmap, refused names).
func (f *FS) secCtxName(sec *SecCtx, cn *cname) (*byte, syscall.Errno) {
	if !f.opts.SecurityLabel || !f.opts.Xattr {
		return nil, syscall.EOPNOTSUPP
	}
	if len(sec.Value) > xattrSizeMax {
		return nil, syscall.E2BIG
	}
	return f.xattrName(sec.Name, cn)
}

// labelFD labels the newly created file open as fd.
func (f *FS) labelFD(fd int, sec *SecCtx) syscall.Errno {
	var cn cname
	p, errno := f.secCtxName(sec, &cn)
	if errno != 0 {
		return errno
	}
	return sysFsetxattr(fd, p, sec.Value, 0)
}

// labelName labels name in dirfd, just created (a directory, symlink or
// special file, which must not be opened: it is set through its O_PATH
// fd's /proc/self/fd name); on failure it removes the object again (rmdir:
// a directory).
func (f *FS) labelName(dirfd int, name *byte, sec *SecCtx, rmdir bool) syscall.Errno {
	errno := f.labelPath(dirfd, name, sec)
	if errno != 0 {
		fl := 0
		if rmdir {
			fl = unix.AT_REMOVEDIR
		}
		sysUnlinkat(dirfd, name, fl)
	}
	return errno
}

func (f *FS) labelPath(dirfd int, name *byte, sec *SecCtx) syscall.Errno {
	var cn cname
	p, errno := f.secCtxName(sec, &cn)
	if errno != 0 {
		return errno
	}
	pfd, errno := sysOpenat(dirfd, name, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if errno != 0 {
		return errno
	}
	defer sysClose(pfd)
	var b fdName
	path := procName(&b, pfd)
	return f.onWorker(func() syscall.Errno { return sysSetxattr(path, p, sec.Value, 0) })
}
