package passthrough

import (
	"syscall"

	gofuse "github.com/hanwen/go-fuse/v2/fuse"
)

// SetupMapping: no DAX window yet.
func (f *FS) SetupMapping(h *gofuse.InHeader, fh, foffset, length, flags, moffset uint64) syscall.Errno {
	return syscall.ENOSYS
}

// RemoveMapping: no DAX window yet.
func (f *FS) RemoveMapping(moffset, length uint64) syscall.Errno { return syscall.ENOSYS }
