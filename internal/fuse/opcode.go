package fuse

import "strconv"

// FUSE opcodes (include/uapi/linux/fuse.h). go-fuse keeps its own
// unexported, so the daemon defines them.
const (
	OpLookup        = 1
	OpForget        = 2
	OpGetattr       = 3
	OpSetattr       = 4
	OpReadlink      = 5
	OpSymlink       = 6
	OpMknod         = 8
	OpMkdir         = 9
	OpUnlink        = 10
	OpRmdir         = 11
	OpRename        = 12
	OpLink          = 13
	OpOpen          = 14
	OpRead          = 15
	OpWrite         = 16
	OpStatfs        = 17
	OpRelease       = 18
	OpFsync         = 20
	OpSetxattr      = 21
	OpGetxattr      = 22
	OpListxattr     = 23
	OpRemovexattr   = 24
	OpFlush         = 25
	OpInit          = 26
	OpOpendir       = 27
	OpReaddir       = 28
	OpReleasedir    = 29
	OpFsyncdir      = 30
	OpGetlk         = 31
	OpSetlk         = 32
	OpSetlkw        = 33
	OpAccess        = 34
	OpCreate        = 35
	OpInterrupt     = 36
	OpBmap          = 37
	OpDestroy       = 38
	OpIoctl         = 39
	OpPoll          = 40
	OpNotifyReply   = 41
	OpBatchForget   = 42
	OpFallocate     = 43
	OpReaddirplus   = 44
	OpRename2       = 45
	OpLseek         = 46
	OpCopyFileRange = 47
	OpSetupMapping  = 48
	OpRemoveMapping = 49
	OpSyncfs        = 50
	OpTmpfile       = 51
	OpStatx         = 52
)

var opNames = [...]string{
	OpLookup: "LOOKUP", OpForget: "FORGET", OpGetattr: "GETATTR", OpSetattr: "SETATTR",
	OpReadlink: "READLINK", OpSymlink: "SYMLINK", OpMknod: "MKNOD", OpMkdir: "MKDIR",
	OpUnlink: "UNLINK", OpRmdir: "RMDIR", OpRename: "RENAME", OpLink: "LINK", OpOpen: "OPEN",
	OpRead: "READ", OpWrite: "WRITE", OpStatfs: "STATFS", OpRelease: "RELEASE", OpFsync: "FSYNC",
	OpSetxattr: "SETXATTR", OpGetxattr: "GETXATTR", OpListxattr: "LISTXATTR",
	OpRemovexattr: "REMOVEXATTR", OpFlush: "FLUSH", OpInit: "INIT", OpOpendir: "OPENDIR",
	OpReaddir: "READDIR", OpReleasedir: "RELEASEDIR", OpFsyncdir: "FSYNCDIR", OpGetlk: "GETLK",
	OpSetlk: "SETLK", OpSetlkw: "SETLKW", OpAccess: "ACCESS", OpCreate: "CREATE",
	OpInterrupt: "INTERRUPT", OpBmap: "BMAP", OpDestroy: "DESTROY", OpIoctl: "IOCTL", OpPoll: "POLL",
	OpNotifyReply: "NOTIFY_REPLY", OpBatchForget: "BATCH_FORGET", OpFallocate: "FALLOCATE",
	OpReaddirplus: "READDIRPLUS", OpRename2: "RENAME2", OpLseek: "LSEEK",
	OpCopyFileRange: "COPY_FILE_RANGE", OpSetupMapping: "SETUPMAPPING",
	OpRemoveMapping: "REMOVEMAPPING", OpSyncfs: "SYNCFS", OpTmpfile: "TMPFILE", OpStatx: "STATX",
}

// OpName returns the opcode's name, or its number for unknown opcodes.
func OpName(op uint32) string {
	if op < uint32(len(opNames)) && opNames[op] != "" {
		return opNames[op]
	}
	return "OP" + strconv.FormatUint(uint64(op), 10)
}
